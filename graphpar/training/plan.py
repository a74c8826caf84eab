"""What every rank of a training run needs, made once by whoever compiles (`TrainPlan`).

The plan is plain data, so that it travels to worker processes (a job folder) or to torchrun's
other ranks (a broadcast from rank 0): the device program as IR text, the mesh, each input's
and each state tensor's global shape and layout, and how the module's `state_dict` keys and
torch.optim's state map onto the step's state (for checkpoints a plain module loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.ir.layout import Layout
from graphpar.ir.mesh import Mesh

if TYPE_CHECKING:
    from graphpar.compiler.api import Compiled

ADAM_STEP = "optim.step"  # graphpar.capture.optim.STEP: Adam's one step counter


@dataclass
class Tensor:
    """A tensor of the step as every rank sees it: its global shape, dtype and layout."""

    shape: tuple[int, ...]
    dtype: str
    layout: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def placements(self) -> Layout:
        return Layout.parse(self.layout)


@dataclass
class TrainPlan:
    """A compiled training step, as data every rank can rebuild its part from."""

    name: str
    program: str  # the device program's IR text (every rank runs it)
    targets: list[str | None]  # its outputs' targets, which do not print
    mesh_shape: tuple[int, ...]
    axes: list[tuple[int, ...]]  # the mesh axes its collectives use
    inputs: dict[str, Tensor]  # the user's inputs, then the targets, in call order
    state: dict[str, Tensor]  # parameters, buffers, optimizer state, constants
    loss_index: int
    # module state_dict key -> the state tensor it is (tied weights: the one that carries it)
    model_keys: dict[str, str]
    # parameter key -> {"exp_avg": state name, ...}: torch.optim's per-parameter state
    optimizer_keys: dict[str, dict[str, str]]
    optimizer: dict[str, object]  # kind and hyper-parameters ("kind": "adam", "lr": ...)
    estimated_seconds: float  # the plan's step time on the cost model's cluster (estimated)
    cluster: str
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # state_dict keys the
    # step does not read (non-persistent in the step): saved as they were built
    # a pipelined step: its stages, microbatches, schedule and each stage's devices (global
    # ranks); None for an SPMD step
    pipeline: dict | None = None
    world_size: int | None = None  # processes it runs on, when not the mesh's size
    # how it was planned: "auto" (auto-shard's ILP) or a hand plan's name (hand_plans.py)
    plan_name: str = "auto"

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.mesh_shape)

    @property
    def world(self) -> int:
        return self.world_size or self.mesh.size

    def shape_summary(self) -> dict[str, int]:
        """What the plan does, counted from it (an SPMD step; empty for a pipelined one):
        `tensors`, the module's parameters and buffers the step reads, and how many are
        `sharded` across devices; `collectives`, the device program's group collectives, and
        `collectives_run`, how many a step runs once its all-reduces go in buckets, as
        `TrainRank` runs them (`graphpar.runtime.overlap`)."""
        if self.pipeline is not None:
            return {}
        from graphpar.ir.parser import parse
        from graphpar.ir.spmd_ops import GROUP_OPS
        from graphpar.runtime.overlap import DEFAULT_BUCKET_BYTES, defer_reduced, plan_buckets

        held = set(self.model_keys.values())
        sharded = sum(not self.state[name].placements().is_replicated for name in held)
        graph = parse(self.program)
        defer_reduced(graph)
        buckets = plan_buckets(graph, DEFAULT_BUCKET_BYTES)
        total = sum(1 for n in graph.nodes if n.op in GROUP_OPS)
        return {"tensors": len(held), "sharded": sharded, "collectives": total,
                "collectives_run": total - sum(len(b.members) for b in buckets) + len(buckets)}

    @property
    def tokens_per_step(self) -> int:
        """Elements of the first input per step: tokens for a language model."""
        first = next(iter(self.inputs.values()))
        return int(torch.Size(first.shape).numel())


def plan_from(compiled: Compiled, name: str, cluster: str, plan_name: str = "auto"
              ) -> TrainPlan:
    """The plan of a compiled training step (`graphpar.compile(..., mode="train")`), planned
    as `plan_name` says ("auto" or a hand plan's name)."""
    from graphpar.ir.graph import OutputRole, Role
    from graphpar.ir.printer import print_graph
    from graphpar.ir.spmd_ops import GROUP_OPS, node_axes

    spmd, glob = compiled.spmd, compiled.captured.graph
    shapes = {v.name: v.type for v in glob.inputs}
    axes = sorted({node_axes(n) for n in spmd.nodes if n.op in GROUP_OPS})

    def described(v) -> Tensor:
        t = shapes[v.name]
        return Tensor(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(v.layout))

    inputs = {v.name: described(v) for v in spmd.inputs if v.role is Role.INPUT}
    state = {v.name: described(v) for v in spmd.inputs if v.role is not Role.INPUT}
    return TrainPlan(
        name=name, program=print_graph(spmd, show_source=False, show_cost=False),
        targets=[o.target for o in spmd.outputs], mesh_shape=tuple(compiled.mesh.shape),
        axes=[tuple(a) for a in axes], inputs=inputs, state=state,
        loss_index=next(i for i, o in enumerate(spmd.outputs) if o.role is OutputRole.LOSS),
        estimated_seconds=compiled.plan.step_seconds, cluster=cluster, plan_name=plan_name,
        **state_keys(glob, compiled.spec_or_raise(), state, compiled.optimizer))


def state_keys(glob, spec, state: dict[str, Tensor], opt) -> dict:
    """How the module's `state_dict` and torch.optim's state map onto the step's `state`
    (`glob`: the captured training graph): TrainPlan's model_keys, optimizer_keys,
    optimizer and constants."""
    from graphpar.ir.graph import Role

    module_keys = list(spec.real_module().state_dict())
    tied = dict(glob.attrs.get("tied", ()))
    model_keys = {k: tied.get(k, k) for k in module_keys if tied.get(k, k) in state}
    constants = {k: v.detach().clone() for k, v in spec.module.state_dict().items()
                 if k not in model_keys}
    params = [v.name for v in glob.inputs if v.role is Role.PARAM]
    optimizer_keys: dict[str, dict[str, str]] = {p: {} for p in params}
    for v in glob.inputs:
        if v.role is Role.OPTIM_STATE and v.name != ADAM_STEP:
            param, _, slot = v.name.rpartition(".")
            optimizer_keys.setdefault(param, {})[slot] = v.name
    if ADAM_STEP in state:
        for slots in optimizer_keys.values():
            slots["step"] = ADAM_STEP
    optimizer = {"kind": type(opt).__name__.lower(), **(vars(opt) if opt is not None else {})}
    return {"model_keys": model_keys, "optimizer_keys": optimizer_keys,
            "optimizer": optimizer, "constants": constants}


def pipeline_plan_from(pipe, spec, mesh: Mesh, name: str, cluster: str) -> TrainPlan:
    """The plan of a pipelined training step (`compiler.pipelined.PipelineCompiled`, its
    stages sharded as planned, or a `compiler.token_pipelined.TokenPipeline`): no SPMD program
    (the stages' programs travel in the pipeline job, `runtime.pipeline.describe_job`), every
    state tensor whole on each device of its stage (laid out replicated), the inputs at the
    full batch."""
    from graphpar.ir.graph import Role

    tokens = pipe if hasattr(pipe, "token_slices") else None  # a TokenPipeline
    pipe = tokens.pipe if tokens is not None else pipe
    glob = pipe.captured.graph
    names = pipe.captured.user_inputs
    full = (*spec.inputs, *spec.targets)
    inputs = {n: Tensor(tuple(t.shape), str(t.dtype).removeprefix("torch."), "{R}")
              for n, t in zip(names, full)}
    state = {v.name: Tensor(tuple(v.type.shape), str(v.type.dtype).removeprefix("torch."), "{R}")
             for v in glob.inputs if v.role is not Role.INPUT}
    estimated = pipe.plan.est_step_seconds if pipe.plan is not None else 0.0
    # the token pipeline runs one process per stage (a stage on several devices runs them in
    # lockstep there); the microbatch pipeline one per device
    devices = ([[s] for s in range(pipe.stages)] if tokens is not None
               else [list(d) for d in pipe.devices])
    return TrainPlan(
        name=name, program="", targets=[], mesh_shape=tuple(mesh.shape), axes=[],
        inputs=inputs, state=state, loss_index=0, estimated_seconds=estimated,
        cluster=cluster, world_size=sum(len(d) for d in devices),
        pipeline={"stages": pipe.stages, "microbatches": pipe.microbatches,
                  "schedule": (tokens or pipe).schedule_name, "devices": devices,
                  "token_slices": list(tokens.token_slices) if tokens is not None else None},
        **state_keys(glob, spec, state, pipe.optimizer))


def initial_state(compiled: Compiled, plan: TrainPlan) -> list[dict[str, torch.Tensor]]:
    """Each rank's shards of the state the step starts from (the module as built, the
    optimizer's zeros)."""
    from graphpar.runtime.spmd import shard_tensor

    state, mesh = compiled.captured.state, plan.mesh
    return [{name: shard_tensor(state[name], t.placements(), mesh, rank)
             for name, t in plan.state.items()} for rank in range(mesh.size)]
