"""Tensor-parallel serving on CPU ranks: rank 0 in the engine's process, the others as workers.

vLLM's arrangement: one scheduler and one block manager (in the engine), one device program per
rank (the decoder's prefill and decode programs, planned by
:mod:`graphpar.passes.autoshard.serving` and lowered to collectives), and every step's inputs —
token ids, positions, slot mapping, block tables, context lengths — sent by the driver to every
rank before the ranks run the step together; the collectives inside the programs go over a gloo
process group.

The driver (rank 0, this process):

1. plans and lowers the programs and writes them to a job directory as IR text, with each
   worker's weight shards;
2. starts ``python -m graphpar.runtime.tensor_parallel JOBDIR`` per worker with torchrun's
   environment and joins them in a gloo process group;
3. per step, sends the command (step tensors, block copies, swaps) down each worker's stdin,
   then runs its own share; the plan leaves the logits whole on every rank and the driver
   samples.

Every rank, the driver included, parses the same program text and fits the same templates
(:func:`load_rank`), so all run one program. A worker that fails leaves its message in the job
directory; the driver raises it as a GenerationError and stops the others. Commands travel by
pipe rather than by a collective so that an idle engine never times a worker out; a worker whose
pipe closes (the driver exited) exits too.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.errors import GenerationError, GraphparError
from graphpar.ir.graph import Graph, Role
from graphpar.ir.mesh import Mesh
from graphpar.ir.printer import print_graph
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.runtime.graph_template import GraphTemplate
from graphpar.runtime.launch import (
    LOOPBACK,
    free_port,
    from_peer,
    log_tail,
    report_rank_error,
    torchrun_env,
)
from graphpar.runtime.paged_model import ModelRank

__all__ = ["TensorParallelRanks", "load_rank", "main"]

_ALIVE = "graphpar/alive/{}"
_POLL_S = 0.01


def _program_files(name: str, variants: Mapping[str, int]) -> dict[str | None, str]:
    return {None: f"{name}.gpir", **{sym: f"{name}.{sym}.gpir" for sym in variants}}


def load_rank(jobdir: Path, state: dict[str, torch.Tensor], comm) -> ModelRank:
    """Rank ``comm.rank``'s :class:`ModelRank` from the job directory's programs."""
    from graphpar.ir.parser import parse

    job = json.loads((jobdir / "job.json").read_text())
    templates = {}
    for name, spec in job["programs"].items():
        files = _program_files(name, spec["variants"])
        graphs = {sym: parse((jobdir / f).read_text(), f) for sym, f in files.items()}
        templates[name] = GraphTemplate.fit(
            graphs[None], spec["base_sizes"],
            {sym: (size, graphs[sym]) for sym, size in spec["variants"].items()})
    return ModelRank(templates["prefill"], templates["decode"], state,
                     num_cpu_blocks=job["num_cpu_blocks"], kernel=job["kernel"], comm=comm)


class TensorParallelRanks:
    """Rank 0 here and ranks 1..tp-1 in worker processes, run as one :class:`ModelRank`.

    Args:
        graphs: the decoder's global paged programs, ``name -> (base graph, base sizes,
            {symbol: (size, graph)})`` with names "decode" and "prefill".
        state: the whole model's weights by graph input name.
        tp: the number of ranks. plan: "auto" or "megatron" (serving plans), costed on
            ``cluster`` (a preset name or cluster file).
        timeout: seconds a collective or the start-up may wait for a peer.
    """

    def __init__(self, graphs: Mapping[str, tuple[Graph, dict, dict]],
                 state: dict[str, torch.Tensor], tp: int, *, plan: str = "auto",
                 cluster: str = "cpu", num_cpu_blocks: int = 0, kernel: str = "auto",
                 timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> None:
        from graphpar.passes.autoshard.serving import plan_serving
        from graphpar.runtime.gloo import GlooCommunicator
        from graphpar.runtime.spmd import shard_tensor

        if dist.is_available() and dist.is_initialized():
            raise GenerationError("torch.distributed is already initialized in this process; "
                                  "tensor-parallel serving starts its own gloo process group")
        say = progress or (lambda message: None)
        self.tp, self.timeout = tp, timeout
        self.programs = plan_serving(graphs, tp, plan, cluster)
        self.mesh = Mesh((tp,))
        self.jobdir = Path(tempfile.mkdtemp(prefix="graphpar-tp-"))
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self.jobdir)
        try:
            axes = sorted({node_axes(n) for p in self.programs.values() for g in _graphs(p)
                           for n in g.nodes if n.op in GROUP_OPS})
            self._write_job(num_cpu_blocks, kernel, axes)
            layouts = {**self.programs["prefill"].layouts, **self.programs["decode"].layouts}
            persistent = sorted({v.name for p in self.programs.values() for v in p.base.inputs
                                 if v.role in (Role.PARAM, Role.BUFFER) and v.name in state})
            say(f"starting {tp - 1} tensor-parallel worker process(es)")
            for rank in range(1, tp):
                torch.save({name: shard_tensor(state[name], layouts[name], self.mesh, rank)
                            .clone() for name in persistent}, self.jobdir / f"weights{rank}.pt")
            self._start(axes)
            self.comm = GlooCommunicator(self.mesh, 0, axes)
            own = {name: shard_tensor(state[name], layouts[name], self.mesh, 0).contiguous()
                   for name in persistent}
            self.weight_bytes = sum(_nbytes(state[name]) for name in persistent)
            self.rank_weight_bytes = sum(_nbytes(t) for t in own.values())
            self.rank = load_rank(self.jobdir, own, self.comm)
            self._collective(self.comm.barrier)  # every worker has loaded its programs
        except BaseException:
            self.close()
            raise
        self.prefill_template = self.rank.prefill_template
        self.decode_template = self.rank.decode_template
        self.key_caches = self.rank.key_caches
        self.value_caches = self.rank.value_caches

    def summary(self) -> str:
        """What the plan does, in a line: collectives per step, each rank's share."""
        decode = self.programs["decode"]
        collectives = {name: sum(1 for n in p.base.nodes if n.op in GROUP_OPS)
                       for name, p in self.programs.items()}
        cache = next(v.type for v in decode.base.inputs if v.name == "key_cache.0")
        whole = next(v.type for v in decode.plan.input_layout if v.name == "key_cache.0")
        mib = 2**20
        return (f"{decode.plan.name.removeprefix('serving-')} plan on {self.tp} ranks: "
                f"{collectives['decode']} collectives per decode step, "
                f"{collectives['prefill']} per prefill step; rank 0 holds "
                f"{self.rank_weight_bytes / mib:.1f} of {self.weight_bytes / mib:.1f} MiB of "
                f"weights and {cache.shape[2]} of {whole.shape[2]} kv heads of every block")

    # --- start-up ---------------------------------------------------------------------------

    def _write_job(self, num_cpu_blocks: int, kernel: str, axes) -> None:
        programs = {}
        for name, program in self.programs.items():
            files = _program_files(name, program.variants)
            graphs = {None: program.base, **{s: g for s, (_, g) in program.variants.items()}}
            for sym, file in files.items():
                (self.jobdir / file).write_text(print_graph(graphs[sym], show_source=True,
                                                            show_cost=False))
            programs[name] = {"base_sizes": program.base_sizes,
                              "variants": {s: n for s, (n, _) in program.variants.items()}}
        job = {"tp": self.tp, "programs": programs, "num_cpu_blocks": num_cpu_blocks,
               "kernel": kernel, "axes": [list(a) for a in axes], "timeout": self.timeout}
        (self.jobdir / "job.json").write_text(json.dumps(job))

    def _start(self, axes) -> None:
        for attempt in range(2):
            port = free_port()
            try:
                store = dist.TCPStore(LOOPBACK, port, self.tp, is_master=True,
                                      timeout=timedelta(seconds=self.timeout),
                                      wait_for_workers=False)
                break
            except (RuntimeError, OSError):  # the port was taken in between: once more
                if attempt:
                    raise
        for rank in range(1, self.tp):
            log = open(self.jobdir / f"log{rank}.txt", "wb")
            try:
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "graphpar.runtime.tensor_parallel", str(self.jobdir)],
                    env=torchrun_env(rank, self.tp, port), stdin=subprocess.PIPE, stdout=log,
                    stderr=subprocess.STDOUT))
            finally:
                log.close()
        deadline = time.monotonic() + self.timeout
        keys = [_ALIVE.format(r) for r in range(1, self.tp)]
        while not store.check(keys):
            self._check_workers()
            if time.monotonic() > deadline:
                raise GenerationError(f"tensor-parallel workers did not start within "
                                      f"{self.timeout:g} s{self._log_tail()}")
            time.sleep(_POLL_S)
        dist.init_process_group("gloo", store=store, rank=0, world_size=self.tp,
                                timeout=timedelta(seconds=self.timeout))

    # --- what the engine calls --------------------------------------------------------------

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        self._send(("run", kind, sizes, step))
        return self._collective(self.rank.run, kind, sizes, step)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self._send(("copy_blocks", list(pairs)))
            self.rank.copy_blocks(pairs)

    def swap_out(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send(("swap_out", dict(mapping)))
            self.rank.swap_out(mapping)

    def swap_in(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send(("swap_in", dict(mapping)))
            self.rank.swap_in(mapping)

    def close(self) -> None:
        """Stop the workers, leave the process group, remove the job directory."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    pickle.dump(("stop",), proc.stdin)
                    proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._finalizer()

    # --- failures ---------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        if self._closed:
            raise GenerationError("the tensor-parallel ranks are stopped (closed, or stopped "
                                  "after an error)")
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self._procs:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._fail(None)

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException | None):
        """Raise the first worker's own error if one failed, else ``exc``; stop every rank."""
        # a worker's failure reaches rank 0 as a broken connection: give it time to say why
        wait = 3.0 if exc is None or from_peer(exc) else 0.0
        deadline = time.monotonic() + wait
        message = self._worker_error()
        while message is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            message = self._worker_error()
        self.close()
        if message is not None:
            raise GenerationError(message) from None
        if isinstance(exc, GraphparError):
            raise exc
        if exc is not None:
            raise GenerationError(f"tensor-parallel rank 0 failed: {exc}") from exc
        raise GenerationError("a tensor-parallel worker exited")

    def _worker_error(self) -> str | None:
        for rank in range(1, self.tp):
            path = self.jobdir / f"error{rank}.txt"
            text = path.read_text().strip() if path.exists() else ""
            if text and not text.startswith("[peer]"):  # its own error, not a broken link
                return f"tensor-parallel rank {rank} failed: {text}"
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code not in (None, 0):
                return f"tensor-parallel rank {rank} exited with code {code}{self._log_tail()}"
        return None

    def _check_workers(self) -> None:
        message = self._worker_error()
        if message is not None:
            raise GenerationError(message)

    def _log_tail(self) -> str:
        return "".join(log_tail(self.jobdir, rank, 10) for rank in range(1, self.tp))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _graphs(program) -> list[Graph]:
    return [program.base, *(g for _, g in program.variants.values())]


def _shutdown(procs: list[subprocess.Popen], jobdir: Path) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    shutil.rmtree(jobdir, ignore_errors=True)


# --- the worker ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Serve as rank $RANK of the job in directory argv[0] until stdin closes."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ["RANK"])
    jobdir = Path(argv[0])
    commands = sys.stdin.buffer
    try:
        job = json.loads((jobdir / "job.json").read_text())
        timeout = timedelta(seconds=float(job["timeout"]))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              job["tp"], is_master=False, timeout=timeout)
        store.set(_ALIVE.format(rank), "1")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=job["tp"],
                                timeout=timeout)
        from graphpar.runtime.gloo import GlooCommunicator

        comm = GlooCommunicator(Mesh((job["tp"],)), rank, [tuple(a) for a in job["axes"]])
        weights = torch.load(jobdir / f"weights{rank}.pt", weights_only=True)
        model = load_rank(jobdir, weights, comm)
        comm.barrier()
        while True:
            try:
                command = pickle.load(commands)
            except EOFError:
                break
            if command[0] == "stop":
                break
            getattr(model, command[0])(*command[1:])
        return 0
    except BaseException as exc:  # report it where the driver looks, exit non-zero
        return report_rank_error(jobdir, rank, exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
