"""One process per rank over gloo on loopback: the launcher and the per-rank worker.

The launcher writes a job directory (graph text, each rank's inputs, the mesh), starts one
`python -m graphpar.runtime.launch JOBDIR` per rank with torchrun's environment
(MASTER_ADDR=127.0.0.1, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), and
collects each rank's outputs and byte records from the directory. The worker reads only that
environment and the directory, so `torchrun --nproc-per-node N -m graphpar.runtime.launch
JOBDIR` runs the same job.

A rank that fails writes its message to `error<rank>.txt`; the launcher then kills the other
ranks (they would wait in a collective) and raises BackendError with that message. Nothing
waits without a bound: the process group has the job's timeout and the launcher kills every
rank when it passes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from graphpar.errors import BackendError, GraphparError
from graphpar.ir.mesh import Mesh
from graphpar.ir.printer import print_graph
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.runtime.comm import CommRecord
from graphpar.runtime.spmd import GraphArg, Inputs, MeshArg, SpmdResult, load_program

__all__ = ["free_port", "from_peer", "log_tail", "main", "report_rank_error", "run_multiprocess",
           "torchrun_env"]

LOOPBACK = "127.0.0.1"
_POLL_S = 0.01
_GRACE_S = 3.0


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
    env.setdefault("OMP_NUM_THREADS", "1")  # world_size processes share this machine's cores
    ifname = _loopback_ifname()
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def run_multiprocess(graph: GraphArg, per_rank_inputs: Sequence[Inputs], mesh: MeshArg = None,
                     timeout: float = 120.0, *, deterministic: bool = True) -> SpmdResult:
    """See `graphpar.runtime.spmd.run_spmd_multiprocess`."""
    graphs, mesh = load_program(graph, mesh)
    world = mesh.size
    if len(per_rank_inputs) != world:
        raise BackendError(f"{len(per_rank_inputs)} input sets given for a {world}-rank mesh; "
                           "give one per rank, in the mesh's row-major order")
    texts: dict[int, str] = {}
    graph_file = []
    for g in graphs:
        texts.setdefault(id(g), print_graph(g, show_source=True, show_cost=False))
        graph_file.append(f"graph{list(texts).index(id(g))}.gpir")
    axes = sorted({node_axes(n) for g in graphs for n in g.nodes if n.op in GROUP_OPS})
    with tempfile.TemporaryDirectory(prefix="graphpar-spmd-") as tmp:
        jobdir = Path(tmp)
        for i, text in enumerate(texts.values()):
            (jobdir / f"graph{i}.gpir").write_text(text)
        for rank, inputs in enumerate(per_rank_inputs):
            # views are saved with their whole storage: save their own copy instead
            own = (lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t)
            if hasattr(inputs, "keys"):
                inputs = {k: own(inputs[k]) for k in inputs.keys()}
            else:
                inputs = [own(t) for t in inputs]
            torch.save(inputs, jobdir / f"inputs{rank}.pt")
        job = {"mesh": list(mesh.shape), "device_ids": list(mesh.device_ids),
               "graphs": graph_file, "axes": [list(a) for a in axes], "timeout": timeout,
               "deterministic": deterministic}
        (jobdir / "job.json").write_text(json.dumps(job))
        for attempt in range(2):
            try:
                return _launch(jobdir, world, timeout)
            except _PortInUse:
                if attempt:
                    raise BackendError("SPMD launch failed twice: the rendezvous port on "
                                       f"{LOOPBACK} was taken") from None
    raise AssertionError("unreachable")


class _PortInUse(Exception):
    pass


def _launch(jobdir: Path, world: int, timeout: float) -> SpmdResult:
    for f in jobdir.glob("result*.pt"):
        f.unlink()
    for f in jobdir.glob("error*.txt"):
        f.unlink()
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world):
            env = torchrun_env(rank, world, port)
            log = open(jobdir / f"log{rank}.txt", "wb")  # closed below
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "graphpar.runtime.launch", str(jobdir)], env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # the others fail soon after (their peer died): let them say so, briefly,
                # so the rank whose own error started it can be told apart
                grace = min(deadline, time.monotonic() + _GRACE_S)
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(_POLL_S)
                codes = [p.poll() for p in procs]  # None: still running, killed now
                _kill(procs)
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                raise _failure(jobdir, failed, codes)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                _kill(procs)
                running = [r for r, c in enumerate(codes) if c is None]
                raise BackendError(
                    f"SPMD run on {world} processes timed out after {timeout:g} s; ranks "
                    f"{running} were still running (a collective no rank matched, or a recv "
                    f"with no send?).{log_tail(jobdir, running[0])}")
            time.sleep(_POLL_S)
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    outputs, records = [], []
    for rank in range(world):
        data = torch.load(jobdir / f"result{rank}.pt", weights_only=True)
        outputs.append(data["outputs"])
        records.append([CommRecord(**{**r, "axes": tuple(r["axes"])}) for r in data["records"]])
    return SpmdResult(outputs, records)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def log_tail(jobdir: Path, rank: int, lines: int = 15) -> str:
    try:
        text = (jobdir / f"log{rank}.txt").read_text(errors="replace").strip()
    except OSError:
        return ""
    if not text:
        return ""
    return f"\nlast output of rank {rank}:\n" + "\n".join(text.splitlines()[-lines:])


def _failure(jobdir: Path, failed: list[int], codes: list[int | None]) -> Exception:
    """The error of the first failed rank that left a message (its own error, not a peer's
    broken connection, when one can tell)."""
    messages = {}
    for rank in range(len(codes)):
        path = jobdir / f"error{rank}.txt"
        if path.exists():
            messages[rank] = path.read_text(errors="replace").strip()
    if any("EADDRINUSE" in m or "ddress already in use" in m for m in messages.values()):
        return _PortInUse()
    own = [r for r in failed if r in messages and not messages[r].startswith("[peer]")]
    rank = (own or [r for r in failed if r in messages] or failed)[0]
    if rank in messages:
        body = messages[rank].removeprefix("[peer]").strip()
    else:
        body = f"exited with code {codes[rank]}{log_tail(jobdir, rank)}"
    others = sorted(set(failed) - {rank})
    note = f" (ranks {others} failed too)" if others else ""
    finished = [r for r, c in enumerate(codes) if c == 0]
    if messages.get(rank, "").startswith("[peer]") and finished:
        body += (f"\n(ranks {finished} had finished their programs while rank {rank} was "
                 "still communicating: do all ranks run matching collectives?)")
    return BackendError(f"SPMD rank {rank} of {len(codes)} failed{note}: {body}")


# ------------------------------------------------------------------------- the worker

def main(argv: Sequence[str] | None = None) -> int:
    """Run rank $RANK of the job in directory argv[0]; write result<rank>.pt or
    error<rank>.txt. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    jobdir = Path(argv[0]) if argv else Path(".")
    initialized = False
    try:
        job = json.loads((jobdir / "job.json").read_text())
        world = int(os.environ["WORLD_SIZE"])
        mesh = Mesh(tuple(job["mesh"]), tuple(job["device_ids"]))
        if world != mesh.size:
            raise BackendError(f"WORLD_SIZE={world} but the job's mesh {mesh} has {mesh.size} "
                               "devices")
        from graphpar.backends.reference import run
        from graphpar.ir.parser import parse
        from graphpar.runtime.gloo import GlooCommunicator

        graph_name = job["graphs"][rank]
        graph = parse((jobdir / graph_name).read_text(), graph_name)
        inputs = torch.load(jobdir / f"inputs{rank}.pt", weights_only=True)
        torch.distributed.init_process_group(
            "gloo", init_method="env://", rank=rank, world_size=world,
            timeout=timedelta(seconds=float(job["timeout"])))
        initialized = True
        comm = GlooCommunicator(mesh, rank, [tuple(a) for a in job["axes"]],
                                deterministic=job["deterministic"])
        outputs = run(graph, inputs, comm=comm)
        comm.finish()
        tmp = jobdir / f"result{rank}.pt.tmp"
        torch.save({"outputs": list(outputs), "records": [r.as_dict() for r in comm.records]},
                   tmp)
        os.replace(tmp, jobdir / f"result{rank}.pt")
        return 0
    except BaseException as exc:  # report everything (before peers notice), exit non-zero
        return report_rank_error(jobdir, rank, exc)
    finally:
        if initialized:
            torch.distributed.destroy_process_group()


def report_rank_error(jobdir: Path, rank: int, exc: BaseException) -> int:
    """Write rank `rank`'s failure to `error<rank>.txt` (where the launcher looks) and stderr;
    returns the exit status 1. A broken collective (another rank most likely died) is marked
    `[peer]`, a GraphparError is its message, anything else its traceback."""
    if from_peer(exc):
        message = f"[peer] {exc}"
    elif isinstance(exc, GraphparError):
        message = str(exc)
    else:
        message = traceback.format_exc()
    try:
        (jobdir / f"error{rank}.txt").write_text(message)
    except OSError:
        pass
    print(message, file=sys.stderr)
    return 1


def from_peer(exc: BaseException | None) -> bool:
    """Whether a torch.distributed communication error is in `exc`'s cause chain."""
    from graphpar.runtime.gloo import CommunicationError

    kinds = (CommunicationError, getattr(torch.distributed, "DistError", CommunicationError))
    while exc is not None:
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__
    return False


if __name__ == "__main__":
    sys.exit(main())
