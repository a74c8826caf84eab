"""One worker group: ranks in their own processes, started torchrun-style, running commands.

A :class:`WorkerGroup` hosts the rendezvous store on a free loopback port (as torchrun's agent
does; a port taken in between is retried), starts ``python -m graphpar.runtime.workers
MODULE:FACTORY JOBDIR`` for each of its ranks with torchrun's environment, and then sends
commands down every worker's stdin. Each worker joins the gloo process group through that
store, builds its handler with ``FACTORY(jobdir, rank, world)``, and runs each command
``(name, *args)`` as ``handler.name(*args)`` until it is told to stop or its stdin closes (the
driver exited). The process that owns the group may be a rank itself (tensor-parallel serving:
rank 0 runs in the engine) or none (an SPMD job: every rank is a worker). Launchers use it
through :mod:`graphpar.runtime.jobs`, the job protocol (the job folder, calls and replies).

A worker that fails writes its message to ``error<rank>.txt`` in the job directory and exits;
the group reports the failed rank by number with that message (a rank's own error before a
peer's broken connection) or, if it left none, its exit code and the tail of its log. Nothing
waits without a bound: every wait has the group's timeout, and :meth:`WorkerGroup.stop` kills
what does not exit.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from graphpar.errors import BackendError, GraphparError

__all__ = ["LOOPBACK", "WorkerGroup", "free_port", "from_peer", "log_tail", "main",
           "report_rank_error", "torchrun_env", "worker_threads"]

LOOPBACK = "127.0.0.1"
_POLL_S = 0.01
_GRACE_S = 3.0  # how long the other ranks get to say why after one fails
_TIMEOUT_ENV = "GRAPHPAR_WORKER_TIMEOUT_S"
_STARTED = "graphpar/started/{}"
_DONE = "graphpar/done/{}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def worker_threads() -> int:
    """The intra-op threads each worker runs with: $OMP_NUM_THREADS, else 1 (ranks share
    this machine's cores)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This process's environment plus what torchrun gives rank `rank` of `world` on this
    machine (rendezvous on 127.0.0.1:`port`), with graphpar importable."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(world),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p),
    })
    env["OMP_NUM_THREADS"] = str(worker_threads())
    ifname = _loopback_ifname()
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


class WorkerGroup:
    """Ranks ``ranks`` (default: all) of a ``world``-rank gloo job, each a worker process.

    Args:
        world: the number of ranks in the process group.
        factory: ``"module:function"``; each worker calls ``function(jobdir, rank, world)``
            once it has joined the process group, and runs its commands on the result.
        jobdir: the job's directory (what the factory reads; logs and errors go there too).
        ranks: the ranks that are worker processes; the others are this process's to play.
        timeout: seconds any wait (a collective, the start, a command) may take.
        name: what the ranks are called in messages ("SPMD", "tensor-parallel").
    """

    def __init__(self, world: int, factory: str, jobdir: Path, *,
                 ranks: Sequence[int] | None = None, timeout: float = 120.0,
                 name: str = "worker") -> None:
        self.world, self.factory, self.jobdir = world, factory, Path(jobdir)
        self.ranks = list(range(world) if ranks is None else ranks)
        self.timeout, self.name = timeout, name
        self.processes: dict[int, subprocess.Popen] = {}
        self.store: dist.TCPStore | None = None
        self._sent = 0
        self._stopped = False

    # --- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Host the store on a free port and start every worker (returns at once)."""
        for attempt in range(3):
            port = free_port()
            try:
                self.store = dist.TCPStore(LOOPBACK, port, None, is_master=True,
                                           timeout=timedelta(seconds=self.timeout),
                                           wait_for_workers=False)
                break
            except (RuntimeError, OSError):  # the port was taken in between: another one
                if attempt == 2:
                    raise BackendError(f"{self.name}: could not host the rendezvous store on "
                                       f"{LOOPBACK} (three ports taken)") from None
        for rank in self.ranks:
            env = torchrun_env(rank, self.world, port)
            env[_TIMEOUT_ENV] = str(self.timeout)
            with open(self.jobdir / f"log{rank}.txt", "wb") as log:
                self.processes[rank] = subprocess.Popen(
                    [sys.executable, "-m", "graphpar.runtime.workers", self.factory,
                     str(self.jobdir)], env=env, stdin=subprocess.PIPE, stdout=log,
                    stderr=subprocess.STDOUT)

    def wait_started(self) -> None:
        """Wait until every worker has reached the store (so a process group can be joined
        without waiting on a rank that died while starting)."""
        keys = [_STARTED.format(r) for r in self.ranks]
        self._wait(lambda: self.store.check(keys), "to start")

    # --- commands ---------------------------------------------------------------------------

    def send(self, name: str, *args: Any) -> int:
        """Send command ``handler.name(*args)`` to every worker; returns its number for
        :meth:`wait`. A worker that is gone raises the group's failure."""
        if self._stopped:
            raise BackendError(f"the {self.name} workers are stopped (closed, or stopped after "
                               "an error)")
        self._sent += 1
        data = pickle.dumps((name, *args), protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self.processes.values():
            try:
                proc.stdin.write(data)  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                self.fail()
        return self._sent

    def wait(self, command: int, *, timeout: float | None = None,
             poll: Callable[[], None] | None = None) -> None:
        """Wait until every worker has finished command number ``command``: at most
        ``timeout`` seconds (default the group's; a long command, a training run, gives
        ``inf`` and relies on its ranks' own collective timeouts), calling ``poll`` between
        checks (to show progress)."""
        keys = [_DONE.format(r) for r in self.ranks]

        def finished() -> bool:
            if poll is not None:
                poll()
            return self.store.check(keys) and all(  # type: ignore[union-attr]
                int(self.store.get(k)) >= command for k in keys)  # type: ignore[union-attr]
        self._wait(finished, "to finish", timeout)

    def finished(self, command: int) -> list[int]:
        """The workers that have finished command number ``command``."""
        return [r for r in self.ranks if self.store.check([_DONE.format(r)])  # type: ignore
                and int(self.store.get(_DONE.format(r))) >= command]  # type: ignore

    def _wait(self, done: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            if any(p.poll() not in (None, 0) for p in self.processes.values()):
                self.fail()
            if time.monotonic() > deadline:
                running = [r for r, p in self.processes.items() if p.poll() is None]
                self.stop(kill=True)
                raise BackendError(
                    f"{self.name} ranks {running} did not {what.removeprefix('to ')} within "
                    f"{timeout:g} s: timed out (a collective no rank matched, or a recv "
                    f"with no send?){log_tail(self.jobdir, running[0]) if running else ''}")
            time.sleep(_POLL_S)

    # --- failures ---------------------------------------------------------------------------

    def fail(self, exc: BaseException | None = None, grace: float = _GRACE_S):
        """Stop every worker and raise the failure (:meth:`collect_failure`) as a
        BackendError; without one, raise ``exc`` (this process's own error, as a rank)."""
        message = self.collect_failure(exc, grace)
        if message is None and exc is not None:
            raise exc
        raise BackendError(message or f"the {self.name} workers stopped")

    def collect_failure(self, exc: BaseException | None = None, grace: float = _GRACE_S
                        ) -> str | None:
        """Stop every worker; returns what failed (:meth:`failure`), or None if no worker did.

        A worker's failure reaches the other ranks as a broken connection, so the workers get
        up to ``grace`` seconds to say why (none when ``exc``, this process's error as a rank,
        is its own rather than a broken connection)."""
        wait = grace if exc is None or from_peer(exc) else 0.0
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self._own_error() is None and any(
                p.poll() is None for p in self.processes.values()):
            time.sleep(_POLL_S)
        message = self.failure()
        self.stop(kill=True)
        return message

    def _own_error(self) -> int | None:
        return next((r for r in self.ranks if (m := self._message(r)) is not None
                     and not m.startswith("[peer]")), None)

    def _message(self, rank: int) -> str | None:
        path = self.jobdir / f"error{rank}.txt"
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            return None
        return text or None

    def failure(self) -> str | None:
        """What failed, naming the rank: a rank's own error first, then one that exited
        without a message (it died: the others' broken connections are its doing; with its
        log tail), then one that saw a peer's connection break."""
        codes = {r: p.poll() for r, p in self.processes.items()}
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        messages = {r: m for r in self.ranks if (m := self._message(r)) is not None}
        own = [r for r in self.ranks if r in messages and not messages[r].startswith("[peer]")]
        candidates = (own or [r for r in failed if r not in messages]
                      or [r for r in failed if r in messages])
        if not candidates:
            return None
        rank = candidates[0]
        others = sorted(set(failed) - {rank})
        note = f" (ranks {others} failed too)" if others else ""
        if rank not in messages:
            return (f"{self.name} rank {rank} exited with code {codes[rank]}{note}"
                    f"{log_tail(self.jobdir, rank)}")
        body = messages[rank].removeprefix("[peer]").strip()
        finished = [r for r in self.finished(self._sent) if r != rank] if self._sent else []
        if messages[rank].startswith("[peer]") and finished:
            body += (f"\n(ranks {finished} had finished their programs while rank {rank} was "
                     "still communicating: do all ranks run matching collectives?)")
        return f"{self.name} rank {rank} of {self.world} failed{note}: {body}"

    # --- stop -------------------------------------------------------------------------------

    def stop(self, kill: bool = False) -> None:
        """Tell every worker to stop and wait for it (10 s at most, then kill it); with
        ``kill``, kill them at once."""
        if self._stopped:
            return
        self._stopped = True
        for proc in self.processes.values():
            try:
                if proc.poll() is None and not kill:
                    pickle.dump(("stop",), proc.stdin)  # type: ignore[arg-type]
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            if kill and proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 10.0
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.store = None


def log_tail(jobdir: Path, rank: int, lines: int = 15) -> str:
    """The last `lines` lines rank `rank` printed (its log in the job directory), as a
    paragraph to append to a message; empty if it printed nothing."""
    try:
        text = (jobdir / f"log{rank}.txt").read_text(errors="replace").strip()
    except OSError:
        return ""
    if not text:
        return ""
    return f"\nlast output of rank {rank}:\n" + "\n".join(text.splitlines()[-lines:])


def report_rank_error(jobdir: Path, rank: int, exc: BaseException) -> int:
    """Write rank `rank`'s failure to `error<rank>.txt` (where the group looks) and stderr;
    returns the exit status 1. A broken collective (another rank most likely died) is marked
    `[peer]`, a GraphparError is its message, anything else its traceback."""
    if from_peer(exc):
        message = f"[peer] {exc}"
    elif isinstance(exc, GraphparError):
        message = str(exc)
    else:
        message = "".join(traceback.format_exception(exc))
    try:
        (jobdir / f"error{rank}.txt").write_text(message)
    except OSError:
        pass
    print(message, file=sys.stderr)
    return 1


def from_peer(exc: BaseException | None) -> bool:
    """Whether a torch.distributed communication error is in `exc`'s cause chain."""
    from graphpar.runtime.gloo import CommunicationError

    kinds = (CommunicationError, getattr(dist, "DistError", CommunicationError))
    while exc is not None:
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__
    return False


# --- the worker ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Be rank $RANK of a group: argv is ``MODULE:FACTORY JOBDIR``; run commands from stdin
    until told to stop or stdin closes. Returns the exit status."""
    factory_name, jobdir_name = list(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jobdir = Path(jobdir_name)
    commands = sys.stdin.buffer
    try:
        timeout = timedelta(seconds=float(os.environ.get(_TIMEOUT_ENV, "120")))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,
                              is_master=False, timeout=timeout)
        store.set(_STARTED.format(rank), "1")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        module, _, function = factory_name.partition(":")
        handler = getattr(importlib.import_module(module), function)(jobdir, rank, world)
        done = 0
        while True:
            try:
                name, *args = pickle.load(commands)
            except EOFError:
                break
            if name == "stop":
                break
            getattr(handler, name)(*args)
            done += 1
            store.set(_DONE.format(rank), str(done))
        return 0
    except BaseException as exc:  # report it where the group looks, exit non-zero
        return report_rank_error(jobdir, rank, exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
