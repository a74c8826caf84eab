"""Tensor-parallel serving on CPU ranks: rank 0 in the engine's process, the others as workers.

vLLM's arrangement: one scheduler and one block manager (in the engine), one device program per
rank (the decoder's prefill and decode programs, planned by
:mod:`graphpar.passes.autoshard.serving` and lowered to collectives), and every step's inputs —
token ids, positions, slot mapping, block tables, context lengths — sent by the driver to every
rank before the ranks run the step together; the collectives inside the programs go over a gloo
process group.

The driver (rank 0, this process):

1. writes the programs (planned and lowered by the compiler) to a job folder as IR text, with
   each worker's weight shards (a :class:`~graphpar.runtime.jobs.Job`, the one job protocol);
2. starts the job's workers (each builds its rank with :func:`serve_rank`) and joins them in a
   gloo process group as rank 0;
3. per step, sends the command (step tensors, block copies, swaps) to the workers, then runs
   its own share; the plan leaves the logits whole on every rank and the driver samples.

Every rank, the driver included, parses the same program text and fits the same templates
(:func:`load_rank`), so all run one program. A worker that fails leaves its message in the job
folder; the driver raises it as a GenerationError and stops the others. Commands travel by
the group's pipes rather than by a collective so that an idle engine never times a worker out;
a worker whose pipe closes (the driver exited) exits too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphpar.errors import BackendError, GenerationError, GraphparError
from graphpar.ir.graph import Graph, Role
from graphpar.ir.graph_template import GraphTemplate
from graphpar.ir.mesh import Mesh
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.runtime.gloo import GlooCommunicator
from graphpar.runtime.jobs import Job, JobFolder, rank_file
from graphpar.runtime.spmd import shard_tensor
from graphpar.runtime.workers import from_peer
from graphpar.serving.model_rank import ModelRank

if TYPE_CHECKING:  # the compiler's result type only: the runtime does not plan
    from graphpar.passes.autoshard.serving import ServingProgram

__all__ = ["TensorParallelRanks", "load_rank", "serve_rank"]


def load_rank(jobdir: Path, state: dict[str, torch.Tensor], comm) -> ModelRank:
    """Rank ``comm.rank``'s :class:`ModelRank` from the job folder's programs."""
    folder = JobFolder(jobdir)
    job = folder.description
    templates = {}
    for name, spec in job["programs"].items():
        base = folder.read_graph(spec["base"])
        templates[name] = GraphTemplate.fit(
            base, spec["base_sizes"],
            {sym: (size, folder.read_graph(entry))
             for sym, (size, entry) in spec["variants"].items()})
    return ModelRank(templates["prefill"], templates["decode"], state,
                     num_cpu_blocks=job["num_cpu_blocks"], kernel=job["kernel"], comm=comm)


class WorkerFailures:
    """How a driver of worker processes (tensor-parallel ranks, pipeline stages) turns a
    failure into one GenerationError: a command that cannot be sent, or a collective that
    breaks, stops every worker and raises the first worker's own error when one failed. The
    driver has ``job``, ``group``, ``_closed`` and ``close()``; the messages name its kind."""

    STOPPED = "the workers are stopped (closed, or stopped after an error)"
    PEER_STOPPED = "a worker stopped"
    FAILED = "serving failed"

    def _send(self, *command) -> None:
        if self._closed:
            raise GenerationError(self.STOPPED)
        try:
            self.job.send(*command)
        except BackendError as exc:  # a worker is gone: the group says which and why
            self.close()
            raise GenerationError(str(exc)) from None

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            message = self.group.collect_failure(exc)
            self.close()
            if message is not None:
                raise GenerationError(message) from None
            if isinstance(exc, GraphparError):
                raise
            if from_peer(exc):
                raise GenerationError(f"{self.PEER_STOPPED}: {exc}") from exc
            raise GenerationError(f"{self.FAILED}: {exc}") from exc


class TensorParallelRanks(WorkerFailures):
    """Rank 0 here and ranks 1..tp-1 in worker processes, run as one :class:`ModelRank`.

    Args:
        programs: the decoder's "decode" and "prefill" programs planned and lowered for ``tp``
            ranks (``graphpar.passes.autoshard.serving.plan_serving``).
        state: the whole model's weights by graph input name.
        tp: the number of ranks.
        timeout: seconds a collective or the start-up may wait for a peer.
    """

    STOPPED = "the tensor-parallel ranks are stopped (closed, or stopped after an error)"
    PEER_STOPPED = "a tensor-parallel worker stopped"
    FAILED = "tensor-parallel rank 0 failed"

    def __init__(self, programs: Mapping[str, ServingProgram], state: dict[str, torch.Tensor],
                 tp: int, *, num_cpu_blocks: int = 0, kernel: str = "auto",
                 timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            raise GenerationError("torch.distributed is already initialized in this process; "
                                  "tensor-parallel serving starts its own gloo process group")
        say = progress or (lambda message: None)
        self.tp, self.timeout = tp, timeout
        self.programs = dict(programs)
        self.mesh = Mesh((tp,))
        self.job = Job(tp, "graphpar.serving.tensor_parallel:serve_rank", prefix="tp",
                       ranks=range(1, tp), timeout=timeout, name="tensor-parallel")
        self.jobdir, self.group = self.job.path, self.job.group
        self._closed = False
        self._finalizer = weakref.finalize(self, self.job.close, True)
        try:
            axes = sorted({node_axes(n) for p in self.programs.values() for g in _graphs(p)
                           for n in g.nodes if n.op in GROUP_OPS})
            self._write_job(num_cpu_blocks, kernel, axes)
            layouts = {**self.programs["prefill"].layouts, **self.programs["decode"].layouts}
            persistent = sorted({v.name for p in self.programs.values() for v in p.base.inputs
                                 if v.role in (Role.PARAM, Role.BUFFER) and v.name in state})
            say(f"starting {tp - 1} tensor-parallel worker process(es)")
            self.job.save_each("weights", {
                rank: {name: shard_tensor(state[name], layouts[name], self.mesh, rank)
                       for name in persistent} for rank in range(1, tp)})
            self._start()
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
        folder = self.job.folder
        programs = {}
        for name, program in self.programs.items():
            programs[name] = {
                "base": folder.write_graph(f"{name}.gpir", program.base, source=True),
                "base_sizes": program.base_sizes,
                "variants": {sym: (size, folder.write_graph(f"{name}.{sym}.gpir", g,
                                                            source=True))
                             for sym, (size, g) in program.variants.items()}}
        folder.describe({"tp": self.tp, "programs": programs, "num_cpu_blocks": num_cpu_blocks,
                         "kernel": kernel, "axes": [list(a) for a in axes],
                         "timeout": self.timeout})

    def _start(self) -> None:
        try:
            self.job.start(wait=True)
        except BackendError as exc:
            raise GenerationError(str(exc)) from None
        dist.init_process_group("gloo", store=self.group.store, rank=0, world_size=self.tp,
                                timeout=timedelta(seconds=self.timeout))

    # --- what the engine calls --------------------------------------------------------------

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        self._send("run", kind, sizes, step)
        return self._collective(self.rank.run, kind, sizes, step)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self._send("copy_blocks", list(pairs))
            self.rank.copy_blocks(pairs)

    def swap_out(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send("swap_out", dict(mapping))
            self.rank.swap_out(mapping)

    def swap_in(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send("swap_in", dict(mapping))
            self.rank.swap_in(mapping)

    def close(self) -> None:
        """Stop the workers, leave the process group, remove the job directory."""
        if self._closed:
            return
        self._closed = True
        self.group.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._finalizer()

def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _graphs(program) -> list[Graph]:
    return [program.base, *(g for _, g in program.variants.values())]


# --- the worker ---------------------------------------------------------------------------------

def serve_rank(jobdir: Path, rank: int, world: int) -> ModelRank:
    """Worker rank ``rank``'s :class:`ModelRank` (its weight shards and programs from the job
    folder), once every rank has loaded its programs; the group runs the driver's commands
    (``run``, ``copy_blocks``, ``swap_out``, ``swap_in``) on it."""
    folder = JobFolder(jobdir)
    comm = GlooCommunicator(Mesh((world,)), rank, [tuple(a) for a in folder.description["axes"]])
    weights = folder.load(rank_file("weights", rank))
    model = load_rank(jobdir, weights, comm)
    comm.barrier()
    return model
