"""Pipelined training from Python: `compile_pipeline(module, inputs, ...)`.

Captures the training step at the microbatch size, cuts it into stages (the given forward
assignment, or equal FLOPs), builds each stage's programs and a schedule, and runs one step on
CPU ranks (in this process, or one process per stage over gloo), comparing it with eager
PyTorch and torch.optim.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.capture import Captured, capture_training
from graphpar.capture.optim import Optimizer
from graphpar.cost.cluster import mesh_for
from graphpar.cost.limits import PlanLimits
from graphpar.cost.timeline import Timeline, chrome_trace, simulate
from graphpar.errors import UsageError
from graphpar.ir.graph import Node, Role
from graphpar.ir.mesh import Mesh
from graphpar.ir.schedule import Schedule
from graphpar.passes.pipeline.partition import equal_flops_stages, follow_forward
from graphpar.passes.pipeline.schedules import SCHEDULES, make_schedule
from graphpar.passes.pipeline.stage_programs import PipelinePrograms, split_stages
from graphpar.runtime.pipeline import (
    PipelineRun,
    run_in_process,
    split_microbatches,
    stage_meshes,
)

if TYPE_CHECKING:
    from graphpar.compiler.check.eager import EagerCheck
    from graphpar.compiler.driver import CompileResult, ModelSpec
    from graphpar.cost.cluster import Cluster
    from graphpar.passes.pipeline.plan import StagePlan

__all__ = ["PipelineCompiled", "SlicedPipeline", "compile_pipeline", "first_microbatch",
           "pipeline_of", "pipeline_of_plan", "slice_and_build", "split_step"]


def split_step(args: Sequence[torch.Tensor], microbatches: int,
               names: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """A step's arguments (inputs, then targets; named `names` in errors) cut along dimension
    0 into `microbatches` equal microbatches, each by name."""
    return split_microbatches(dict(zip(names, args)), microbatches)


def first_microbatch(spec: ModelSpec, microbatches: int) -> ModelSpec:
    """`spec` with its example batch cut to the first of `microbatches` equal microbatches:
    what a pipelined step is captured at."""
    names = [f"input {i}" for i in range(len(spec.inputs))] + [
        f"target {i}" for i in range(len(spec.targets))]
    first = split_step((*spec.inputs, *spec.targets), microbatches, names)[0]
    return dataclasses.replace(spec, inputs=tuple(first[n] for n in names[:len(spec.inputs)]),
                               targets=tuple(first[n] for n in names[len(spec.inputs):]))


@dataclass
class PipelineCompiled:
    """A training step cut into pipeline stages, with its schedule, ready to run."""

    captured: Captured  # the training step at the microbatch size, and its starting state
    programs: PipelinePrograms
    schedule: Schedule
    schedule_name: str
    microbatches: int
    spec: ModelSpec | None = None
    optimizer: Optimizer | None = None
    last_run: PipelineRun | None = field(default=None, repr=False)
    # stage -> phase -> ShardedPhase, for stages that run on a sub-mesh of several devices
    sharded: dict = field(default_factory=dict, repr=False)
    plan: StagePlan | None = None  # the slice-stages result it was built from, if any
    # what the plan was made for: the physical mesh (on its cluster) and the user's limits,
    # which every stage's re-solve on its sub-mesh keeps (`sharded_as_planned`)
    mesh: Mesh | None = None
    limits: PlanLimits | None = None

    def on_submeshes(self, submeshes: Mapping[int, Mesh | str],
                     cluster: Cluster | str = "cpu",
                     limits: PlanLimits | None = None) -> PipelineCompiled:
        """The same stages, those in `submeshes` (stage -> mesh, e.g. {1: "1x2"}; text is
        laid on `cluster`) sharded by the auto-shard ILP on their sub-mesh within `limits`
        (default: those it was planned under, else the cluster's memory per device and 30 s
        per solve) and run as SPMD programs there."""
        from graphpar.passes.pipeline.lower_mpmd import shard_stages

        meshes = {s: mesh_for(m, cluster) for s, m in submeshes.items()}
        limits = limits or self.limits or PlanLimits.parse(cluster=cluster)
        sharded = shard_stages(self.programs, meshes, limits)
        return dataclasses.replace(self, sharded=sharded, last_run=None)

    def planned_submeshes(self, cluster: Cluster | str | None = None) -> dict[int, Mesh]:
        """Each stage whose planned logical mesh has several devices: that logical mesh, on
        `cluster` (default: the one it was planned for, else "cpu")."""
        if self.plan is None:
            return {}
        cluster = self._cluster(cluster)
        return {i: mesh_for(s.logical_mesh, cluster) for i, s in enumerate(self.plan.stages)
                if math.prod(s.logical_mesh) > 1}

    def sharded_as_planned(self, cluster: Cluster | str | None = None,
                           limits: PlanLimits | None = None) -> PipelineCompiled:
        """Each stage whose planned logical mesh has several devices sharded by the ILP on
        it (`planned_submeshes`, `on_submeshes`) within `limits` (default: those it was
        planned under); unchanged without a plan or with one device per stage."""
        submeshes = self.planned_submeshes(cluster)
        return (self.on_submeshes(submeshes, self._cluster(cluster), limits) if submeshes
                else self)

    def _cluster(self, cluster: Cluster | str | None) -> Cluster | str:
        """`cluster`, else the one the pipeline was planned for, else "cpu"."""
        return cluster or (self.mesh.cluster if self.mesh is not None else "cpu")

    def estimate(self, cluster: str | Cluster = "cpu", dtype: str = "fp32") -> Timeline:
        """The schedule's timeline as the cost model estimates it on `cluster` (a preset or a
        cluster file, e.g. one `graphpar calibrate` measured): each phase's ops priced
        by the roofline of `graphpar.cost.compute` on the cluster's achieved rates, each
        boundary's bytes per microbatch as a point-to-point transfer between neighbouring
        devices. Estimated, not measured."""
        from graphpar.cost.cluster import get_cluster, mesh_for
        from graphpar.cost.communication import send_recv_cost
        from graphpar.cost.compute import Roofline, node_seconds

        chosen = get_cluster(cluster)
        roof = Roofline.of(chosen, dtype)

        def seconds(phase: str, s: int) -> float:
            graph = self.programs.stages[s].program(phase)
            return sum(node_seconds(n, roof) for n in graph.nodes) if graph is not None else 0.0

        stages = range(self.stages)
        forward = [seconds("F", s) for s in stages]
        weight = [seconds("W", s) for s in stages]
        backward = [seconds("I", s) + weight[s] if self.schedule_name == "zb"
                    else seconds("B", s) for s in stages]
        update = [seconds("U", s) for s in stages]
        line = mesh_for(f"1x{max(self.stages, 2)}", chosen)
        comm = [send_recv_cost(max(self.programs.bytes_sent(s)), line, 1).seconds
                for s in range(self.stages - 1)]
        return simulate(self.schedule, forward, backward, comm,
                        weight if self.schedule_name == "zb" else None, update)

    def trace(self, path: str) -> dict:
        """Write the last run's measured timeline as a Chrome trace (chrome://tracing)."""
        if self.last_run is None:
            raise UsageError("nothing has run yet: call run() or check() first")
        return chrome_trace(self.last_run.spans, path)

    def with_schedule(self, name: str) -> PipelineCompiled:
        """The same stages run by schedule `name`."""
        plan = make_schedule(name, self.stages, self.microbatches)
        return dataclasses.replace(self, schedule=plan, schedule_name=name, last_run=None)

    @property
    def stages(self) -> int:
        return len(self.programs.stages)

    @property
    def devices(self) -> list[tuple[int, ...]]:
        """Each stage's devices as global ranks: the stages' sub-meshes laid out in order (a
        stage sharded on a sub-mesh has its size, any other one device)."""
        return [m.device_ids for m in stage_meshes(self.stages, self.sharded)]

    @property
    def predicted_bytes(self) -> int:
        """Bytes sent between stages in one step, from the programs' transfer lists, each
        tensor as the tiles it crosses in (`graphpar.ir.cross_mesh`)."""
        from graphpar.passes.pipeline.lower_mpmd import step_bytes_across

        return step_bytes_across(self.programs, self.devices, self.microbatches)

    def mpmd_program(self):
        """The MPMD program of these stages on their sub-meshes (`lower_mpmd`), with the tile
        sends between them."""
        from graphpar.passes.pipeline.lower_mpmd import lower_mpmd

        return lower_mpmd(self.programs, self.devices)

    def run(self, *args: torch.Tensor, processes: bool = False, timed_steps: int = 0,
            warmup: int = 0) -> list[torch.Tensor]:
        """One step on the full batch `args` (inputs then targets): the training graph's
        outputs (mean loss, mean gradients, updates). With `processes` and `timed_steps`, the
        same processes then time that many more steps after `warmup` untimed ones
        (`last_run.step_times`, `last_run.stage_compute_seconds`)."""
        names = self.captured.user_inputs
        if len(args) != len(names):
            raise UsageError(f"the step takes {len(names)} inputs ({', '.join(names)}), got "
                             f"{len(args)}")
        inputs = split_step(args, self.microbatches, names)
        if processes:
            from graphpar.runtime.pipeline import run_multiprocess

            run = run_multiprocess(self.programs, self.schedule, self.captured.state, inputs,
                                   sharded=self.sharded, timed_steps=timed_steps, warmup=warmup)
        else:
            run = run_in_process(self.programs, self.schedule, self.captured.state, inputs,
                                 self.sharded)
        self.last_run = run
        return run.outputs

    def run_steps(self, args: Sequence[torch.Tensor], steps: int, processes: bool = False,
                  timed_steps: int = 0, warmup: int = 0) -> list[list[torch.Tensor]]:
        """`steps` steps on the same full batch `args`, each from the state the last one
        left, the state compiled from the module restored afterwards: every step's outputs.
        `timed_steps`, `warmup`: the last step's processes then time steps, as `run`'s."""
        saved = dict(self.captured.state)
        results = []
        try:
            for k in range(steps):
                last = k == steps - 1
                outputs = self.run(*args, processes=processes,
                                   timed_steps=timed_steps if last else 0,
                                   warmup=warmup if last else 0)
                results.append(outputs)
                self.captured.apply_updates(outputs)
        finally:
            self.captured.state = saved
        return results

    def check(self, processes: bool = False, per_microbatch: bool | None = None,
              steps: int = 1, timed_steps: int = 0, warmup: int = 0, localize: bool = True
              ) -> EagerCheck:
        """Run `steps` steps on the example it was compiled from (state carried) and compare
        every output of each with eager PyTorch in float64 and `steps` torch.optim steps,
        element by element against float32 rounding (`graphpar.compiler.check.eager`): on the full
        batch, or (`per_microbatch`; the default for models with buffers the forward updates,
        i.e. batch norm, whose statistics differ per microbatch) microbatch by microbatch with
        gradient accumulation. `timed_steps`, `warmup`: as `run`'s, after the last step. When
        the check fails and `localize`, it also finds the first stage and phase (and node of a
        sharded stage) that differs (`EagerCheck.where`)."""
        from graphpar.compiler.check.eager import compare, eager_reference

        if self.spec is None:
            raise UsageError("this pipeline does not know the module it came from")
        if per_microbatch is None:
            buffers = {v.name for v in self.captured.graph.inputs_with_role(Role.BUFFER)}
            per_microbatch = any(o.target in buffers for o in self.captured.graph.outputs)
        reference = eager_reference(self.spec, True, self.optimizer, steps,
                                    self.microbatches if per_microbatch else 1)
        outputs = self.run_steps((*self.spec.inputs, *self.spec.targets), steps, processes,
                                 timed_steps, warmup)
        check = compare(self.captured.graph.outputs, outputs, reference)
        if localize and not check.within_tolerance:
            from graphpar.compiler.check.localize import pipeline_difference, state_before

            before = outputs[:check.worst.step - 1]
            check.where = pipeline_difference(
                self, state_before(self.captured.graph, self.captured.state, before))
        return check


def compile_pipeline(module: torch.nn.Module, inputs: Sequence[torch.Tensor], *,
                     loss_fn: Callable, targets: Sequence[torch.Tensor] = (),
                     optimizer: Optimizer | None = None, stages: int = 2,
                     microbatches: int = 4, schedule: str = "1f1b",
                     forward_stage: Callable[..., Mapping[Node, int]] | None = None,
                     keep_grads: bool = False) -> PipelineCompiled:
    """Capture `module`'s training step at the microbatch size (batch / `microbatches`), cut
    it into `stages` stages and build `schedule` ("gpipe", "1f1b" or "zb").

    `forward_stage(graph, stages)` assigns the forward nodes (default: equal FLOPs,
    `equal_flops_stages`); every other node follows (`follow_forward`)."""
    from graphpar.compiler.driver import ModelSpec

    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise UsageError(f"microbatches must be at least 1, got {microbatches}")
    spec = ModelSpec(type(module).__name__, module, tuple(inputs), loss_fn, tuple(targets))
    micro = first_microbatch(spec, microbatches)
    captured = capture_training(copy.deepcopy(module), list(micro.inputs), loss_fn,
                                list(micro.targets), optimizer=optimizer,
                                keep_grads=keep_grads)
    return pipeline_of(captured, stages, microbatches, schedule, forward_stage, spec=spec,
                       optimizer=optimizer)


def pipeline_of(captured: Captured, stages: int, microbatches: int, schedule: str = "1f1b",
                forward_stage: Callable[..., Mapping[Node, int]] | None = None, *,
                spec: ModelSpec | None = None, optimizer: Optimizer | None = None,
                stage_of: Mapping[Node, int] | None = None) -> PipelineCompiled:
    """The pipeline of a training step already captured at the microbatch size: `stage_of`
    gives every node's stage (a `StagePlan`'s), else `forward_stage(graph, stages)` the
    forward nodes' (default: equal FLOPs) and the rest follows them."""
    graph = captured.graph
    if stage_of is None:
        assign = (forward_stage or equal_flops_stages)(graph, stages)
        stage_of = follow_forward(graph, assign)
    # I and W programs are built for every schedule: switching to "zb" needs no rebuild
    programs = split_stages(graph, stage_of, zero_bubble=True)
    plan = make_schedule(schedule, len(programs.stages), microbatches)
    return PipelineCompiled(captured, programs, plan, schedule, microbatches, spec, optimizer)


def pipeline_of_plan(captured: Captured, plan, schedule: str = "1f1b", *,
                     spec: ModelSpec | None = None, optimizer: Optimizer | None = None,
                     cluster: Cluster | str = "cpu",
                     limits: PlanLimits | None = None) -> PipelineCompiled:
    """The pipeline a `slice-stages` result (`StagePlan`) describes, for the graph it was
    computed on: its stages and microbatches, and each stage whose logical mesh has more than
    one device planned by the ILP on it (`PipelineCompiled.sharded_as_planned`, on `cluster`
    within `limits`)."""
    pipe = pipeline_of(captured, len(plan.stages), plan.microbatches, schedule, spec=spec,
                       optimizer=optimizer, stage_of=plan.stage_of)
    pipe.plan = plan
    return pipe.sharded_as_planned(cluster, limits)


@dataclass
class SlicedPipeline:
    """What `slice_and_build` made: the compile of the microbatch step (with the slice-stages
    result in its context) and the pipeline of its stages (not yet sharded on sub-meshes)."""

    result: CompileResult
    plan: StagePlan
    pipe: PipelineCompiled


def slice_and_build(spec: ModelSpec, mesh: Mesh, limits: PlanLimits, *,
                    stages: str | int = "auto", microbatches: int = 4, schedule: str = "1f1b",
                    optimizer: Optimizer | None = None, passes: Sequence = (),
                    keep_grads: bool = False, token_slices: int | None = None,
                    power_of_two_hosts: bool = False) -> SlicedPipeline:
    """Capture `spec`'s training step at the microbatch size (its example batch cut into
    `microbatches` along dimension 0), run `passes` then `slice-stages` on the physical `mesh`
    (hosts x devices per host, or devices for one host; on its cluster) within `limits`, and
    build the stages' programs and `schedule`; the pipeline keeps `mesh` and `limits` for its
    stages' re-solves. `token_slices` (0: the DP chooses, N: N equal slices; None: off) then
    runs `slice-tokens` for the stage plan, which records `token_slices` and `batch_slices` in
    the step graph's attrs. `power_of_two_hosts` limits multi-host sub-meshes to 2, 4, 8 ...
    hosts, as Alpa's search does by default (fewer ILP solves)."""
    from graphpar.compiler.driver import compile_model
    from graphpar.passes.pipeline.plan import StagePlan
    from graphpar.passes.pipeline.slice_stages import SliceStages

    micro = first_microbatch(spec, microbatches)
    slicer = SliceStages.of(mesh, limits, stages=str(stages), microbatches=microbatches,
                            power_of_two_hosts=power_of_two_hosts)
    after = []
    if token_slices is not None:
        from graphpar.passes.pipeline.slice_tokens import SliceTokens

        after.append(SliceTokens(slices=token_slices, cluster=mesh.cluster))
    result = compile_model(micro, "train", [*passes, slicer, *after], optimizer=optimizer,
                           keep_grads=keep_grads)
    plan = result.context.result(StagePlan)
    pipe = pipeline_of(result.captured, len(plan.stages), plan.microbatches, schedule,
                       spec=spec, optimizer=optimizer, stage_of=plan.stage_of)
    pipe.plan, pipe.mesh, pipe.limits = plan, mesh, limits
    return SlicedPipeline(result, plan, pipe)
