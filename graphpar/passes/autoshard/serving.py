"""Tensor-parallel plans for a decoder's serving programs: vLLM's layout, with the ILP's choices.

A serving engine runs a decode and a prefill program, each fitted over symbolic sizes (tokens
``T``, sequences ``N``; see :mod:`graphpar.ir.graph_template`), on ``tp`` ranks. One plan
has to hold at every size, and both programs have to agree on the weights and the KV cache, so
the auto-sharder solves each program's base graph under these constraints:

- the step's inputs (token ids, positions, slot mapping, block tables, context lengths) are
  replicated: the driver sends every rank the same ones;
- the KV caches are sharded by kv heads (replicated when the kv heads do not divide, as with one
  kv head), so every rank keeps its heads' K/V in blocks with the same ids and one block manager
  serves all ranks;
- no dimension that changes with T or N is sharded, so the base graph's plan is every size's
  plan and the lowered programs fit one template;
- the decode program is planned first (it runs most steps); the prefill program keeps the
  weight layouts decode chose.

``plan="auto"`` leaves everything else to the ILP; ``plan="megatron"`` adds the Megatron-LM
hand plan's rules (graphpar.passes.autoshard.hand_plans) under the same constraints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph, Program, Role, Value
from graphpar.ir.layout import Layout, Replicate, Shard
from graphpar.ir.mesh import Mesh
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.hand_plans import _axis_roles, _Filter
from graphpar.passes.autoshard.ilp import Plan, Problem, Reduced
from graphpar.passes.autoshard.strategies import Strategy
from graphpar.passes.lower_spmd import LowerSPMD
from graphpar.passes.manager import Pass, PassContext, PassManager, register_pass

__all__ = ["SERVING_PLANS", "ServingProgram", "ShardServing", "is_kv_cache", "plan_serving",
           "varying_dims"]

SERVING_PLANS = ("auto", "megatron")
_CACHE_PREFIXES = ("key_cache.", "value_cache.")
_KV_HEADS_DIM = 2  # of a cache [num_blocks, block_size, kv_heads, head_size]


def is_kv_cache(name: str | None) -> bool:
    return bool(name) and name.startswith(_CACHE_PREFIXES)


@dataclass
class ServingProgram:
    """One program's device programs (base sizes and one per symbol), and its plan."""

    name: str
    base: Graph
    base_sizes: dict[str, int]
    variants: dict[str, tuple[int, Graph]]
    plan: Plan
    layouts: dict[str, Layout] = field(default_factory=dict)  # per graph input name


def varying_dims(base: Graph, others: Sequence[Graph]) -> dict[Value, set[int]]:
    """Per value of `base`, the dims whose size differs in some graph of `others` (the same
    program captured at other sizes)."""
    base_values = list(base.values())
    found: dict[Value, set[int]] = {}
    for other in others:
        values = list(other.values())
        if len(values) != len(base_values):
            raise ShardingError(f"graph @{base.name} and its variant @{other.name} are not one "
                                "program (different numbers of values)")
        for a, b in zip(base_values, values):
            dims = {d for d, (x, y) in enumerate(zip(a.type.shape, b.type.shape)) if x != y}
            if dims:
                found.setdefault(a, set()).update(dims)
    return found


class _ServingFilter:
    """Which layouts and strategies a serving plan may take (see the module docstring)."""

    def __init__(self, reduced: Reduced, varying: dict[Value, set[int]],
                 fixed: Mapping[str, Layout], plan: str) -> None:
        mesh = reduced.problem.mesh
        self.varying, self.fixed, self.size = varying, fixed, mesh.size
        self.full = Layout((Replicate(),) * mesh.ndim)
        self.megatron = _Filter(reduced, _axis_roles("megatron", mesh)) if plan == "megatron" \
            else None

    def _shards_varying(self, value: Value, layout: Layout | None) -> bool:
        dims = self.varying.get(value)
        return bool(dims) and layout is not None and any(
            p.is_shard() and p.dim in dims for p in layout.placements)

    def cache_layout(self, value: Value) -> Layout:
        kv_heads = value.type.shape[_KV_HEADS_DIM]
        if len(self.full.placements) == 1 and kv_heads > 1 and kv_heads % self.size == 0:
            return Layout((Shard(_KV_HEADS_DIM),))
        return self.full

    def __call__(self, item, choice) -> bool | None:
        if isinstance(item, Value):
            if item.role is Role.INPUT:
                return choice == self.full
            if item.name in self.fixed:
                return choice == self.fixed[item.name]
            if is_kv_cache(item.name):
                return choice == self.cache_layout(item)
            if self._shards_varying(item, choice):
                return False
            return self.megatron(item, choice) if self.megatron else None
        strategy: Strategy = choice
        node = item
        if any(self._shards_varying(o, lay) for o, lay in zip(node.outputs, strategy.outputs)):
            return False
        if any(isinstance(v, Value) and self._shards_varying(v, lay)
               for v, lay in zip(node.inputs, strategy.inputs)):
            return False
        return self.megatron(item, choice) if self.megatron else None


class ServingLayouts(dict[str, Layout]):
    """Weight layouts fixed by the serving programs planned so far, by graph input name: the
    next program keeps them (the engine holds one copy of each weight per rank)."""


@register_pass("shard-serving")
@dataclass
class ShardServing(Pass):
    """Shard one serving program for `tp` ranks: the program's first graph is it at its base
    sizes, the others the same program captured at other sizes; one plan holds for all."""

    tp: int = 2
    plan: str = "auto"
    cluster: str = "cpu"
    time_limit: float = 30.0

    def run(self, program: Program, ctx: PassContext) -> bool:
        if self.plan not in SERVING_PLANS:
            raise ShardingError(f"unknown serving plan {self.plan!r}; choose one of "
                                f"{', '.join(SERVING_PLANS)}")
        base, *others = program
        mesh = mesh_for(str(self.tp), get_cluster(self.cluster))
        fixed = ctx.result(ServingLayouts)
        try:
            solved = solve_serving(base, others, mesh, self.plan, fixed, self.time_limit)
        except ShardingError as exc:
            raise ShardingError(f"no {self.plan} tensor-parallel plan for @{base.name} on "
                                f"{self.tp} ranks: {exc}") from None
        for graph in others:  # before the base graph gains its reshard nodes
            shard_graph(graph, mesh, _moved(solved, graph, base))
        for v in base.inputs:
            if v.role in (Role.PARAM, Role.BUFFER):
                fixed[v.name] = solved.input_layout[v]
        ctx.result(ShardingPlans)[base.name] = solved
        shard_graph(base, mesh, solved)
        return True


def solve_serving(base: Graph, others: Sequence[Graph], mesh: Mesh, plan: str = "auto",
                  fixed: Mapping[str, Layout] | None = None, time_limit: float = 30.0,
                  roofline: Roofline | float | None = None) -> Plan:
    """The `plan` ("auto" or "megatron") for the program whose base graph is `base` and whose
    other sizes are `others`, on `mesh`, keeping the weight layouts in `fixed` (by input
    name); compute priced by `roofline` (default: the mesh's cluster in fp32). `base` is not
    changed."""
    roof = Roofline.of(mesh.cluster, "fp32") if roofline is None else roofline
    reduced = Reduced(Problem(base, mesh, roof))
    allow = _ServingFilter(reduced, varying_dims(base, others), dict(fixed or {}), plan)
    return reduced.solve(None, time_limit, allow=allow, name=f"serving-{plan}")


def plan_serving(programs: Mapping[str, tuple[Graph, Mapping[str, int],
                                              Mapping[str, tuple[int, Graph]]]],
                 tp: int, plan: str = "auto", cluster: str = "cpu",
                 time_limit: float = 30.0) -> dict[str, ServingProgram]:
    """Plan and lower each program (``name -> (base graph, base sizes, {symbol: (size,
    graph)})``, in planning order) for ``tp`` tensor-parallel ranks, through the pass manager
    (shard-serving, then lower-spmd, verified after each). The graphs are global (unsharded)
    and are not changed; the results are device programs for a 1-D mesh."""
    ctx = PassContext()
    manager = PassManager([ShardServing(tp, plan, cluster, time_limit), LowerSPMD()])
    result: dict[str, ServingProgram] = {}
    for name, (base, base_sizes, variants) in programs.items():
        copies = {None: base.copy(), **{sym: g.copy() for sym, (_, g) in variants.items()}}
        for sym, copy in copies.items():  # distinct names in one program
            copy.name = base.name if sym is None else f"{base.name}.{sym}"
        layouts_of = {v.name: v for v in copies[None].inputs}
        try:
            lowered = list(manager.run(Program.of(copies.values()), ctx))
        except ShardingError as exc:
            raise ShardingError(f"the {name} program: {exc}") from None
        devices = dict(zip(copies, lowered))
        for sym, (_, graph) in variants.items():
            devices[sym].name = f"{graph.name}_spmd"
        solved = ctx.result(ShardingPlans)[base.name]
        program = ServingProgram(name, devices[None], dict(base_sizes),
                                 {sym: (size, devices[sym]) for sym, (size, _) in
                                  variants.items()}, solved)
        program.layouts = {n: solved.input_layout[v] for n, v in layouts_of.items()}
        result[name] = program
    return result


def _moved(plan: Plan, graph: Graph, base: Graph) -> Plan:
    """The base graph's plan moved node by node onto `graph`, the same program at other sizes."""
    if len(graph.nodes) != len(base.nodes) or len(graph.inputs) != len(base.inputs):
        raise ShardingError(f"graph @{graph.name} is not the program @{base.name} at other "
                            "sizes")
    return Plan(plan.mesh, {n: plan.node_strategy[b] for n, b in zip(graph.nodes, base.nodes)},
                {v: plan.input_layout[b] for v, b in zip(graph.inputs, base.inputs)},
                plan.compute_seconds, plan.comm_seconds, plan.memory_bytes, plan.stats,
                plan.name, plan.compute_model)
