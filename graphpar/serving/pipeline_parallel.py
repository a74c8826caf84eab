"""Pipeline-parallel serving on CPU ranks: every stage a worker process, the engine apart.

The serving compile cut the decoder's programs into stages by layer
(:mod:`graphpar.serving.stage_split`); each stage is a
:class:`~graphpar.serving.model_rank.ModelRank` of its own blocks, their weights and their KV
caches. The engine keeps one scheduler and one block manager, so every stage gets the same
block tables and slots and holds its own layers of every block.

One batch is in flight at a time (the simple schedule): per step the driver (this process, the
engine's) sends the step's command to every stage worker through the one job protocol
(:class:`~graphpar.runtime.jobs.Job`; commands by the group's pipes, so an idle engine times
nobody out); stage 0 runs and sends what crosses (the hidden states) to stage 1 over gloo;
each stage receives from the one before, runs, and sends on; the last stage sends the logits
to the driver, which samples. Block copies and swaps go to every stage. The stages and the
driver (rank S of S + 1) talk in a gloo process group of their own, not the process's default
one, so one process may drive the stages of several models, as a placement's device group
does. The stages of one
step do not overlap with the next step's (no microbatches in flight): a group of S stages
serves at the speed of one device, its gain being memory (each holds 1/S of the weights and
KV cache), as a pipelined group at low load does.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphpar.errors import BackendError, GenerationError
from graphpar.ir.graph import Role
from graphpar.ir.graph_template import GraphTemplate
from graphpar.runtime.jobs import Job, JobFolder, rank_file
from graphpar.serving.model_rank import ModelRank
from graphpar.serving.tensor_parallel import WorkerFailures

if TYPE_CHECKING:  # the compiler's result type only: the runtime does not compile
    from graphpar.serving.stage_split import ServingStages

__all__ = ["PipelineRanks", "PipelineStage", "serve_stage"]

# what a tensor's header names (gloo sends tensors of these dtypes)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32)
_HEADER = 8  # dtype, rank, up to 6 dimensions


_PREFIX = "graphpar-pipeline/"  # the stages' process group's keys in the job's store


def stage_group(store, rank: int, world: int, timeout: float):
    """The stages' own gloo process group on the job's rendezvous store (every rank joins)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), rank, world,
                                 timedelta(seconds=timeout))


def send_tensors(group, tensors: Sequence[torch.Tensor], dst: int) -> None:
    """Send each tensor (a header with its dtype and shape, then its data) to rank `dst`."""
    for t in tensors:
        t = t.contiguous()
        header = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        group.send([torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.long)],
                   dst, 0).wait()
        group.send([t], dst, 0).wait()


def recv_tensors(group, count: int, src: int) -> list[torch.Tensor]:
    """`count` tensors that :func:`send_tensors` sent from rank `src`."""
    out = []
    for _ in range(count):
        header = torch.empty(_HEADER, dtype=torch.long)
        group.recv([header], src, 0).wait()
        dtype, rank = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty([int(d) for d in header[2:2 + rank]], dtype=dtype)
        group.recv([tensor], src, 0).wait()
        out.append(tensor)
    return out


class PipelineStage:
    """Stage `stage` of `stages`: receives what the stage before sends, runs its programs on it
    and the step's inputs, and sends on what later stages read (the last: the logits, to the
    driver, rank `stages` of the link)."""

    def __init__(self, model: ModelRank, group, stage: int, stages: int,
                 sends: Mapping[str, Sequence[Sequence[str]]]) -> None:
        self.model, self.group, self.stage, self.stages = model, group, stage, stages
        self.sends = {kind: [list(s) for s in per_stage] for kind, per_stage in sends.items()}
        self.targets = {kind: [o.target for o in template.base.outputs] for kind, template in
                        (("prefill", model.prefill_template), ("decode", model.decode_template))}

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]) -> None:
        """Run this stage's share of a step."""
        inputs = dict(step)
        if self.stage > 0:
            names = self.sends[kind][self.stage - 1]
            inputs.update(zip(names, recv_tensors(self.group, len(names), self.stage - 1)))
        outputs = self.model.run_all(kind, sizes, inputs)
        if self.stage == self.stages - 1:
            send_tensors(self.group, outputs[:1], self.stages)
            return
        made = {t: o for t, o in zip(self.targets[kind], outputs) if t is not None}
        send_tensors(self.group, [made[n] if n in made else inputs[n]
                                  for n in self.sends[kind][self.stage]], self.stage + 1)

    def copy_blocks(self, pairs) -> None:
        self.model.copy_blocks(pairs)

    def swap_out(self, mapping: dict[int, int]) -> None:
        self.model.swap_out(mapping)

    def swap_in(self, mapping: dict[int, int]) -> None:
        self.model.swap_in(mapping)


def _weight_names(programs: Mapping[str, tuple]) -> set[str]:
    return {v.name for base, _, _ in programs.values() for v in base.inputs
            if v.role in (Role.PARAM, Role.BUFFER) and not v.name.startswith(
                ("key_cache.", "value_cache."))}


class PipelineRanks(WorkerFailures):
    """Stages 0..S-1 in worker processes, driven from here as one model rank.

    Args:
        stages: the decoder's programs cut into stages (``graphpar.serving.stage_split``).
        state: the whole model's weights by graph input name.
        timeout: seconds a transfer or the start-up may wait for a peer.
    """

    STOPPED = "the pipeline stages are stopped (closed, or stopped after an error)"
    PEER_STOPPED = "a pipeline stage stopped"
    FAILED = "pipeline-parallel serving failed"

    def __init__(self, stages: ServingStages, state: dict[str, torch.Tensor], *,
                 num_cpu_blocks: int = 0, kernel: str = "auto", timeout: float = 300.0,
                 progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda message: None)
        self.stages, self.layers = len(stages), list(stages.layers)
        self.timeout = timeout
        self.job = Job(self.stages, "graphpar.serving.pipeline_parallel:serve_stage",
                       prefix="pp", timeout=timeout, name="pipeline stage")
        self.group = self.job.group
        self._closed = False
        self.link = None
        self._finalizer = weakref.finalize(self, self.job.close, True)
        try:
            self._write_job(stages, num_cpu_blocks, kernel)
            self.job.save_each("weights", [
                {name: state[name] for name in _weight_names(stages.programs[s])}
                for s in range(self.stages)])
            say(f"starting {self.stages} pipeline stage worker processes")
            try:
                self.job.start(wait=True)
            except BackendError as exc:
                raise GenerationError(str(exc)) from None
            self.link = stage_group(self.group.store, self.stages, self.stages + 1, timeout)
            self._collective(lambda: self.link.barrier().wait())  # every stage has loaded
        except BaseException:
            self.close()
            raise
        # stage 0's programs stand for the model's here (graphpar generate --dump-programs)
        self.prefill_template, self.decode_template = (
            GraphTemplate.fit(*stages.programs[0][kind]) for kind in ("prefill", "decode"))
        self.key_caches: list[torch.Tensor] = []  # the caches live in the stages' processes
        self.value_caches: list[torch.Tensor] = []

    def summary(self) -> str:
        return (f"{self.stages} pipeline stages, decoder blocks "
                + ", ".join(f"{a}-{b - 1}" for a, b in self.layers))

    def _write_job(self, stages: ServingStages, num_cpu_blocks: int, kernel: str) -> None:
        folder = self.job.folder
        programs = {}
        for s in range(self.stages):
            programs[str(s)] = {
                kind: {"base": folder.write_graph(f"s{s}.{kind}.gpir", base, source=True),
                       "base_sizes": sizes,
                       "variants": {sym: (size, folder.write_graph(f"s{s}.{kind}.{sym}.gpir", g,
                                                                   source=True))
                                    for sym, (size, g) in variants.items()}}
                for kind, (base, sizes, variants) in stages.programs[s].items()}
        folder.describe({"stages": self.stages, "programs": programs, "sends": stages.sends,
                         "num_cpu_blocks": num_cpu_blocks, "kernel": kernel,
                         "timeout": self.timeout})

    # --- what the engine calls --------------------------------------------------------------

    def run(self, kind: str, sizes: dict[str, int], step: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        self._send("run", kind, sizes, step)
        return self._collective(recv_tensors, self.link, 1, self.stages - 1)[0]

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self._send("copy_blocks", list(pairs))

    def swap_out(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send("swap_out", dict(mapping))

    def swap_in(self, mapping: dict[int, int]) -> None:
        if mapping:
            self._send("swap_in", dict(mapping))

    def close(self) -> None:
        """Stop the stage workers, leave the process group, remove the job directory."""
        if self._closed:
            return
        self._closed = True
        self.group.stop()
        self.link = None
        self._finalizer()


# --- the worker ---------------------------------------------------------------------------------

def serve_stage(jobdir: Path, rank: int, world: int) -> PipelineStage:
    """Stage ``rank``'s :class:`PipelineStage` (its weights and programs from the job folder),
    once every stage has loaded its programs; the group runs the driver's commands (``run``,
    ``copy_blocks``, ``swap_out``, ``swap_in``) on it."""
    folder = JobFolder(jobdir)
    job = folder.description
    templates = {}
    for kind, spec in job["programs"][str(rank)].items():
        templates[kind] = GraphTemplate.fit(
            folder.read_graph(spec["base"]), spec["base_sizes"],
            {sym: (size, folder.read_graph(entry))
             for sym, (size, entry) in spec["variants"].items()})
    model = ModelRank(templates["prefill"], templates["decode"],
                      folder.load(rank_file("weights", rank)),
                      num_cpu_blocks=job["num_cpu_blocks"], kernel=job["kernel"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,
                          is_master=False, timeout=timedelta(seconds=job["timeout"]))
    group = stage_group(store, rank, world + 1, job["timeout"])
    group.barrier().wait()
    return PipelineStage(model, group, rank, world, job["sends"])
