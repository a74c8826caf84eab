"""Token-pipelined training (TeraPipe) from Python and the CLI: a pipeline's stages run a
causal LM's step slice by slice along the sequence, equal to eager PyTorch + torch.optim.

`token_pipeline(pipe, token_slices)` takes a whole-sequence pipeline (`compile_pipeline` or
`slice_and_build`, compiled with keep_grads) and the slice lengths (`token_slices`, as the
`slice-tokens` pass records them), captures each slice's step with explicit keys and values
(`capture.token_slice`, once per (length, offset): shapes are static), cuts it into the
pipeline's stages (`passes.pipeline.token_programs`) and schedules the (microbatch, slice)
items (`passes.pipeline.schedules.token_schedule`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.capture.token_slice import capture_slice_step
from graphpar.compiler.pipelined import split_step
from graphpar.cost.cluster import mesh_for
from graphpar.cost.limits import PlanLimits
from graphpar.errors import GenerationError, UsageError
from graphpar.ir.graph import Role
from graphpar.ir.mesh import Mesh
from graphpar.ir.schedule import Schedule
from graphpar.passes.manager import run_pipeline
from graphpar.passes.pipeline.schedules import token_schedule
from graphpar.passes.pipeline.token_programs import TokenPrograms, split_token_slices
from graphpar.runtime.pipeline import PipelineRun

if TYPE_CHECKING:
    from graphpar.compiler.check.eager import EagerCheck
    from graphpar.compiler.pipelined import PipelineCompiled
    from graphpar.ir.cluster import Cluster

__all__ = ["TokenPipeline", "parse_token_slices", "run_token_pipeline_on_cpu", "token_pipeline"]


@dataclass
class TokenPipeline:
    """A whole-sequence pipeline run token slice by token slice."""

    pipe: PipelineCompiled  # the whole-sequence pipeline: stages, updates, model and optimizer
    programs: TokenPrograms
    schedule: Schedule
    schedule_name: str
    last_run: PipelineRun | None = field(default=None, repr=False)
    # stage -> {"slices": per slice phase -> ShardedPhase, "U": ShardedPhase}: on a sub-mesh
    sharded: dict = field(default_factory=dict, repr=False)
    # tensor constants the slices' steps lifted (GPT-Neo's mask value), by their input names
    constants: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """What the slices' steps read besides their inputs: the step's state and constants."""
        return {**self.pipe.captured.state, **self.constants}

    @property
    def token_slices(self) -> list[int]:
        return self.programs.token_slices

    @property
    def predicted_bytes(self) -> int:
        """Bytes sent between stages in one step, from the slices' transfer lists."""
        return self.programs.step_bytes(self.pipe.microbatches)

    def run(self, *args: torch.Tensor, processes: bool = False) -> list[torch.Tensor]:
        """One step on the full batch `args` (token ids, then targets): the whole step's
        outputs (mean loss, mean gradients, updates)."""
        from graphpar.runtime.token_pipeline import (
            run_tokens_in_process,
            run_tokens_multiprocess,
        )

        names = self.pipe.captured.user_inputs
        if len(args) != len(names):
            raise UsageError(f"the step takes {len(names)} inputs ({', '.join(names)}), got "
                             f"{len(args)}")
        inputs = split_step(args, self.pipe.microbatches, names)
        if processes:
            self.last_run = run_tokens_multiprocess(self.programs, self.schedule,
                                                    self.state, inputs,
                                                    sharded=self.sharded)
        else:
            self.last_run = run_tokens_in_process(self.programs, self.schedule,
                                                  self.state, inputs, self.sharded)
        return self.last_run.outputs

    def run_steps(self, args: Sequence[torch.Tensor], steps: int, processes: bool = False
                  ) -> list[list[torch.Tensor]]:
        """`steps` steps on the same full batch `args`, each from the state the last one
        left, the state compiled from the module restored afterwards: every step's outputs."""
        captured = self.pipe.captured
        saved = dict(captured.state)
        results = []
        try:
            for _ in range(steps):
                outputs = self.run(*args, processes=processes)
                results.append(outputs)
                captured.apply_updates(outputs)
        finally:
            captured.state = saved
        return results

    def check(self, processes: bool = False, steps: int = 1) -> EagerCheck:
        """`steps` steps on the example the pipeline was compiled from (state carried), every
        output compared with eager PyTorch on the whole sequence in float64 and torch.optim,
        element by element against float32 rounding (`graphpar.compiler.check.eager`)."""
        from graphpar.compiler.check.eager import compare, eager_reference

        spec = self.pipe.spec
        if spec is None:
            raise UsageError("this pipeline does not know the module it came from")
        reference = eager_reference(spec, True, self.pipe.optimizer, steps)
        outputs = self.run_steps((*spec.inputs, *spec.targets), steps, processes)
        return compare(self.pipe.captured.graph.outputs, outputs, reference)

    def with_schedule(self, name: str) -> TokenPipeline:
        """The same programs run by the token schedule `name` ("gpipe" or "1f1b")."""
        schedule = token_schedule(name, self.programs.stages, self.pipe.microbatches,
                                  len(self.token_slices))
        return dataclasses.replace(self, schedule=schedule, schedule_name=name, last_run=None)

    def on_submeshes(self, submeshes: Mapping[int, Mesh | str],
                     cluster: Cluster | str = "cpu", limits: PlanLimits | None = None
                     ) -> TokenPipeline:
        """The same stages, those in `submeshes` (stage -> mesh, e.g. {1: "1x2"}; text is
        laid on `cluster`) sharded by the auto-shard ILP on their sub-mesh within `limits`
        (default: those the pipeline was planned under, else the cluster's memory per device
        and 30 s per solve): every slice's F and B and the update, phase by phase
        (`lower_mpmd.shard_stages`), run as SPMD programs there (in lockstep, in this process
        or in the stage's gloo process)."""
        from graphpar.passes.pipeline.lower_mpmd import shard_stages

        meshes = {s: mesh_for(m, cluster) for s, m in submeshes.items()}
        limits = limits or self.pipe.limits or PlanLimits.parse(cluster=cluster)
        per_slice = [shard_stages(sl.programs, meshes, limits) for sl in self.programs.slices]
        updates = _UpdatesOnly([dataclasses.replace(
            st, forward=None, backward=None, input_grad=None, weight_grad=None)
            for st in self.programs.whole.stages])
        sharded_updates = shard_stages(updates, meshes, limits)
        sharded = {s: {"slices": [phases[s] for phases in per_slice],
                       **({"U": sharded_updates[s]["U"]} if "U" in sharded_updates[s] else {})}
                   for s in submeshes}
        return dataclasses.replace(self, sharded=sharded, last_run=None)


@dataclass
class _UpdatesOnly:
    """The whole pipeline's stages with their update programs alone, for `shard_stages`."""

    stages: list


def parse_token_slices(text: str | int | Sequence[int], seq_len: int) -> list[int]:
    """Slice lengths from `--token-slices`: a count N (N slices as equal as can be, the longer
    first, e.g. 3 of 8 tokens -> [3, 3, 2]) or a comma list of lengths summing to `seq_len`."""
    if isinstance(text, int) or (isinstance(text, str) and "," not in text):
        try:
            count = int(text)
        except ValueError:
            raise UsageError(f"--token-slices {text!r}: give a number of slices or a comma "
                             "list of lengths, e.g. 3 or 5,2,1") from None
        if not 1 <= count <= seq_len:
            raise UsageError(f"--token-slices {count}: the sequence has {seq_len} tokens; "
                             f"choose between 1 and {seq_len} slices")
        base, extra = divmod(seq_len, count)
        return [base + (i < extra) for i in range(count)]
    try:
        lengths = ([int(x) for x in text.split(",")] if isinstance(text, str)
                   else [int(x) for x in text])
    except ValueError:
        raise UsageError(f"--token-slices {text!r}: the lengths must be whole numbers, "
                         "e.g. 5,2,1") from None
    if any(n < 1 for n in lengths) or sum(lengths) != seq_len:
        raise UsageError(f"--token-slices {text}: lengths must be positive and sum to the "
                         f"sequence length {seq_len} (they sum to {sum(lengths)})")
    return lengths


def token_pipeline(pipe: PipelineCompiled, token_slices: str | int | Sequence[int],
                   schedule: str = "1f1b") -> TokenPipeline:
    """`pipe`'s stages run token slice by token slice, GPipe- or 1F1B-style over the
    (microbatch, slice) items. `token_slices`: lengths summing to the sequence length, or as
    `parse_token_slices` reads them."""
    spec = pipe.spec
    if spec is None or len(spec.inputs) != 1 or len(spec.targets) != 1:
        raise UsageError("token slicing runs a causal LM's training step, one input (token "
                         "ids) and one target; this pipeline has "
                         + ("no model" if spec is None else
                            f"{len(spec.inputs)} inputs and {len(spec.targets)} targets"))
    names = pipe.captured.user_inputs
    first = split_step((*spec.inputs, *spec.targets), pipe.microbatches, names)[0]
    ids, target = (first[n] for n in names)
    if ids.dim() != 2 or ids.is_floating_point():
        raise UsageError(f"token slicing cuts a causal LM's token ids [batch, sequence]; the "
                         f"step's input {names[0]!r} is {str(ids.dtype).removeprefix('torch.')}"
                         f"{list(ids.shape)}")
    seq_len = ids.shape[1]
    lengths = parse_token_slices(token_slices, seq_len)
    graphs, offset, constants = [], 0, {}
    for j, length in enumerate(lengths):
        try:
            captured = capture_slice_step(copy.deepcopy(spec.module), spec.loss_fn, ids, target,
                                          seq_len, offset, length,
                                          last=j == len(lengths) - 1, name=f"slice{j}")
        except GenerationError as exc:  # the decoder adapter's word on what it can drive
            raise UsageError(f"token slicing drives the model with explicit keys and values: "
                             f"{exc}") from None
        run_pipeline(captured.graph, "dce")  # the surrogate loss's forward (see token_slice)
        for v in captured.graph.inputs_with_role(Role.CONST):  # named apart from other slices'
            constants[f"slice{j}.{v.name}"] = captured.state[v.name]
            v.name = f"slice{j}.{v.name}"
        graphs.append(captured.graph)
        offset += length
    programs = split_token_slices(pipe.programs, graphs, lengths)
    plan = token_schedule(schedule, programs.stages, pipe.microbatches, len(lengths))
    return TokenPipeline(pipe, programs, plan, schedule, constants=constants)


def run_token_pipeline_on_cpu(pipe: PipelineCompiled, token_slices: str | int | Sequence[int],
                              schedule: str = "1f1b", processes: bool = True,
                              trace: str | None = None, cluster: Cluster | str | None = None,
                              steps: int = 1) -> dict:
    """What `--token-slices` with `--run-cpu` runs: one token-pipelined step (one process per
    stage, or in this process), checked against eager PyTorch + torch.optim; `trace` writes
    its measured timeline as a Chrome trace. A stage the pipeline's plan puts on several
    devices is sharded by the ILP on its logical mesh (`TokenPipeline.on_submeshes`, planned
    for `cluster`, by default the pipeline's own, within the limits it was planned under).
    Returns the report section: the slices, the errors, bytes between stages
    (counted as gloo payloads, by the plan's definition, predicted), the measured step
    time."""
    from graphpar.cost.timeline import chrome_trace, timeline_of

    tokens = token_pipeline(pipe, token_slices, schedule)
    submeshes = pipe.planned_submeshes(cluster)
    if submeshes:
        tokens = tokens.on_submeshes(submeshes)
    check = tokens.check(processes=processes, steps=steps)
    run = tokens.last_run
    report = {"token_slices": tokens.token_slices, "schedule": schedule,
              "processes": tokens.programs.stages if processes else 0,
              **check.report(), "lines": check.lines(),
              "bytes_sent": sum(run.bytes_sent), "predicted_bytes": tokens.predicted_bytes,
              # the payloads handed to gloo (None in one process: no wire)
              "bytes_counted": None if run.bytes_counted is None else sum(run.bytes_counted),
              "step_seconds_measured": timeline_of(run.spans).step_seconds}
    report["sharded_stages"] = {str(i): str(mesh) for i, mesh in submeshes.items()}
    if trace:
        chrome_trace(run.spans, trace)
        report["trace"] = trace
    return report
