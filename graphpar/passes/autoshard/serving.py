"""Tensor-parallel plans for a decoder's serving programs: vLLM's layout, with the ILP's choices.

A serving engine runs a decode and a prefill program, each fitted over symbolic sizes (tokens
``T``, sequences ``N``; see :mod:`graphpar.runtime.graph_template`), on ``tp`` ranks. One plan
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

from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph, Role, Value
from graphpar.ir.layout import Layout, Replicate, Shard
from graphpar.ir.mesh import Mesh
from graphpar.passes.autoshard.hand_plans import _axis_roles, _Filter
from graphpar.passes.autoshard.ilp import Plan, Problem, Reduced
from graphpar.passes.autoshard.pass_ import cluster_for, mesh_for, shard_graph
from graphpar.passes.autoshard.strategies import Strategy
from graphpar.passes.lower_spmd import lower_graph

__all__ = ["SERVING_PLANS", "ServingProgram", "is_kv_cache", "plan_serving", "varying_dims"]

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


def plan_serving(programs: Mapping[str, tuple[Graph, Mapping[str, int],
                                              Mapping[str, tuple[int, Graph]]]],
                 tp: int, plan: str = "auto", cluster: str = "cpu",
                 time_limit: float = 30.0) -> dict[str, ServingProgram]:
    """Plan and lower each program (``name -> (base graph, base sizes, {symbol: (size,
    graph)})``, in planning order) for ``tp`` tensor-parallel ranks. The graphs are global
    (unsharded) and are not changed; the results are device programs for a 1-D mesh."""
    if plan not in SERVING_PLANS:
        raise ShardingError(f"unknown serving plan {plan!r}; choose one of "
                            f"{', '.join(SERVING_PLANS)}")
    cluster_spec = cluster_for(cluster)
    mesh = mesh_for(str(tp), cluster_spec)
    peak = cluster_spec.peak_flops("fp32")
    fixed: dict[str, Layout] = {}
    result: dict[str, ServingProgram] = {}
    for name, (base, base_sizes, variants) in programs.items():
        varying = varying_dims(base, [g for _, g in variants.values()])
        reduced = Reduced(Problem(base, mesh, peak))
        allow = _ServingFilter(reduced, varying, fixed, plan)
        try:
            solved = reduced.solve(None, time_limit, allow=allow, name=f"serving-{plan}")
        except ShardingError as exc:
            raise ShardingError(f"no {plan} tensor-parallel plan for the {name} program on "
                                f"{tp} ranks: {exc}") from None
        lowered = {sym: (size, _lower(graph, base, solved, mesh, cluster))
                   for sym, (size, graph) in variants.items()}
        program = ServingProgram(name, _lower(base, base, solved, mesh, cluster),
                                 dict(base_sizes), lowered, solved)
        program.layouts = {v.name: solved.input_layout[v] for v in base.inputs}
        for v in base.inputs:
            if v.role in (Role.PARAM, Role.BUFFER):
                fixed[v.name] = solved.input_layout[v]
        result[name] = program
    return result


def _lower(graph: Graph, base: Graph, plan: Plan, mesh: Mesh, cluster: str) -> Graph:
    """`graph` (the base graph or one captured at other sizes) sharded by the base graph's plan
    and lowered to its device program (`cluster`: the preset name or file, which lower-spmd
    reads again to pick the same collectives the plan priced)."""
    copy = graph.copy()
    if len(copy.nodes) != len(base.nodes) or len(copy.inputs) != len(base.inputs):
        raise ShardingError(f"graph @{graph.name} is not the program @{base.name} at other "
                            "sizes")
    moved = Plan(mesh, {n: plan.node_strategy[b] for n, b in zip(copy.nodes, base.nodes)},
                 {v: plan.input_layout[b] for v, b in zip(copy.inputs, base.inputs)},
                 plan.compute_seconds, plan.comm_seconds, plan.memory_bytes, plan.stats,
                 plan.name)
    shard_graph(copy, mesh, moved)
    copy.attrs.update({"mesh": str(mesh.size), "cluster": cluster})
    return lower_graph(copy)
