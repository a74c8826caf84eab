"""The `slice-stages` pass: Alpa's inter-operator pass over a training step.

1. Cluster the forward ops into L layers (Eq. 6, `clustering.py`); backward ops and optimizer
   updates follow their forward ops (`partition.follow_forward`). Further candidates: Eq.
   6's layers with each block-long one cut once more, the same cut only next to Eq. 6's
   plan's stage ends, and layers of equal op counts where they add few kinds of layers.
   Steps 2-4 run on each, and the plan with the least estimated step is kept.
2. Cost every layer on every (sub-mesh, logical mesh) with graphpar's own auto-shard ILP on
   the layer's stage subgraph. Layers with the same structure (`layer_signature`) share one
   solve, so the number of ILP solves grows with the kinds of layers, not with depth; the
   solves on one logical mesh share their resharding cost tables (layers of different kinds
   still reshard the same activations between the same layouts).
3. A stage of layers i..j on a logical mesh costs its layers' times, plus resharding the
   values its layers pass to each other (from one layer's plan to the next's), plus sending
   its boundary to the next stage (below). Per sub-mesh shape the best logical mesh is kept.
4. The stage DP (Eq. 2-5, `stage_dp.py`) picks stage boundaries and sub-meshes.

Cross-stage communication, which Alpa leaves out: the values crossing the boundary after
layer j (activations forward and their gradients backward, each counted once) are sent once
across meshes (Alpa's local all-gather: every byte crosses once, then is gathered inside the
destination over its fast links, which is not priced), spread over the sending sub-mesh's
links to other hosts (`_sending_bandwidth`). The time is added to the sending stage: it sits
on the first microbatch's path and, not being overlapped, in the steady state too.

The graph is costed as it is given: it is one microbatch's training step (capture at the
microbatch's batch size). The optimizer update runs once per step, so its compute is charged
1/B per microbatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.communication import resharding_cost
from graphpar.cost.compute import Roofline
from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS, PlanLimits
from graphpar.errors import MemoryLimitError, PassError, ShardingError, TimeLimitError
from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import PERSISTENT_ROLES, Graph, Node, OutputRole, Role, Value
from graphpar.ir.layout import Layout
from graphpar.ir.mesh import Mesh, parse_mesh_shape
from graphpar.ir.structure import canonical_order, layer_signature
from graphpar.passes.autoshard.hand_plans import NotApplicable, hand_plan
from graphpar.passes.autoshard.ilp import Problem, Reduced
from graphpar.passes.manager import GraphPass, PassContext, register_pass
from graphpar.passes.pipeline.clustering import (
    DEFAULT_DELTA,
    cluster_bounds,
    default_layer_count,
    equal_ranges,
    forward_chain,
    regular_clusterings,
)
from graphpar.passes.pipeline.partition import (
    follow_forward,
    forward_backward_optimizer,
    stage_subgraph,
)
from graphpar.passes.pipeline.plan import (
    PLANNED,
    LayerSolve,
    LayerSolves,
    PipelineStage,
    StagePlan,
)
from graphpar.passes.pipeline.solve_pool import available_workers, map_in_order
from graphpar.passes.pipeline.stage_dp import (
    StageCosts,
    StageSolution,
    pipeline_seconds,
    place_submeshes,
    solve_stages,
    submesh_shapes,
)
from graphpar.units import format_bytes

LogicalMeshes = Callable[[tuple[int, int]], list[tuple[int, int]]]


def logical_meshes(shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The logical meshes a sub-mesh of (hosts, devices per host) is sharded on: (d / mp, mp)
    for each power of two mp up to the devices per host (mp = 1: one data axis)."""
    hosts, per_host = shape
    devices = hosts * per_host
    return [(devices // mp, mp) for mp in (1 << p for p in range(per_host.bit_length()))
            if mp <= per_host]


@dataclass
class LayerCost:
    """One layer's ILP plan on one logical mesh, and what it costs per microbatch. The plan is
    kept as the layouts the resharding between layers reads, plain data that a worker process
    sends back whole."""

    seconds: float
    persistent_bytes: int  # weights (and their gradients), buffers, optimizer state
    stashed_bytes: int  # forward results the backward reads: kept per microbatch in flight
    # per node of the layer's stage subgraph (in order), the layouts of its results
    result_layouts: tuple[tuple[Layout, ...], ...]
    # per input of the subgraph, its layout if it is an activation (Role.INPUT), else None
    input_layouts: tuple[Layout | None, ...]


@dataclass
class _Layer:
    index: int
    nodes: list[Node]  # forward, backward and update nodes, in `canonical_order`
    forward: list[Node]
    signature: str
    layering: str = ""  # the candidate clustering it is a layer of (for reports)


@dataclass
class StageSearch:
    """Everything the search computed, for reports and benchmarks: the plan, the DP's table,
    how each stage is sharded, and the forward layers."""

    plan: StagePlan
    costs: StageCosts
    stage_families: tuple[str | None, ...]  # per stage: None (the ILP) or its hand plan
    forward_layers: list[tuple[int, int]] = field(default_factory=list)
    # measured wall seconds of each step: clustering, layer costs (ILP), the DP
    seconds: dict[str, float] = field(default_factory=dict)
    # which clustering the plan's layers are: "eq6", FINER, LOCAL, "equal operator" or "given"
    clustering: str = "eq6"


@dataclass
class _Clustered:
    """One candidate clustering of the forward ops into layers, and what the search made of
    it (filled in as it goes)."""

    name: str
    bounds: list[tuple[int, int]]  # (first, last) forward op of each layer
    layer_of: dict[Node, int]  # every node's layer
    units: list[_Layer]
    options: _StageOptions | None = None
    costs: StageCosts | None = None
    chosen: np.ndarray | None = None
    solution: StageSolution | None = None

    @classmethod
    def of(cls, graph: Graph, name: str, bounds: Sequence[tuple[int, int]],
           forward: Sequence[Node], forward_set: set[Node]) -> _Clustered:
        layer_of = follow_forward(graph, {forward[k]: i for i, (a, b) in enumerate(bounds)
                                          for k in range(a, b + 1)})
        return cls(name, list(bounds), layer_of,
                   _units(graph, layer_of, len(bounds), forward_set, name))

    @property
    def kinds(self) -> set[str]:
        return {u.signature for u in self.units}


FINER = "eq6, 2 cuts per block"  # Eq. 6's layers with each block-long one cut once more
LOCAL = "eq6, cut at stage ends"  # Eq. 6's layers, cut as FINER's next to its plan's stage ends


def _split_at_stage_ends(first: _Clustered, finer: _Clustered) -> list[tuple[int, int]]:
    """The first candidate's layers, with those on either side of each of its plan's stage
    boundaries replaced by their pieces in `finer` (a refinement of them): the DP may then
    move each boundary by part of a block, while every other block stays one layer, costed
    by one ILP over the whole block rather than as pieces plus the resharding between them.
    Its layers are kinds the two candidates already have, so it costs no solves."""
    split = {i for a, b, _ in first.solution.stages for i in (a - 1, a, b, b + 1)}
    bounds = []
    for i, (a, b) in enumerate(first.bounds):
        pieces = [(x, y) for x, y in finer.bounds if a <= x <= b]
        bounds += pieces if i in split and pieces and pieces[-1][1] == b else [(a, b)]
    return bounds


def _stage_sized(first: _Clustered, microbatches: int) -> LogicalMeshes:
    """Per sub-mesh shape, the logical meshes the first candidate's table picks for some layer
    range fast enough to be a stage of a faster plan: a plan's step is at least B times its
    slowest stage, so beating the first candidate's step T needs every stage under T / B.
    A finer clustering of the same layers is costed only on these (its stages are the first
    one's, give or take part of a block at each end), which spares the solves of its new
    kinds of layers on logical meshes that no stage of a winning plan would use."""
    bound = first.solution.seconds / microbatches
    picked: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for m, shape in enumerate(first.options.shapes):
        fast = first.chosen[:, :, m][first.costs.seconds[:, :, m] < bound]
        picked[shape] = list(dict.fromkeys(first.options.choices[m][g][0]
                                           for g in sorted(set(fast.tolist()))))
    return lambda shape: picked.get(shape, [])


def _affordable(candidates: list[_Clustered]) -> list[_Clustered]:
    """The first candidate (Eq. 6), and each other one whose layers add at most as many new
    kinds (hence ILP solves) as the first has: the search at most doubles its solves. Equal-op
    layers of a deep model are all different (every block cut at another op), so there they
    are left out; on a shallow one they cost about what Eq. 6's do."""
    kept, kinds = candidates[:1], set(candidates[0].kinds)
    for c in candidates[1:]:
        if c.bounds != kept[0].bounds and len(c.kinds - kinds) <= len(candidates[0].kinds):
            kept.append(c)
            kinds |= c.kinds
    return kept


def slice_stages(graph: Graph, mesh: Mesh | str | Sequence[int],
                 cluster: str | Cluster = "dgx-a100",
                 microbatches: int = 4, stages: int = 0, layers: int = 0,
                 delta: float = DEFAULT_DELTA, epsilon: float = 1e-6,
                 limits: PlanLimits | None = None, dtype: str = "fp32",
                 forward_layers: Sequence[tuple[int, int]] | None = None,
                 families: Sequence[str | None] = (None,),
                 logical: LogicalMeshes = logical_meshes,
                 fixed: Sequence[tuple[int, int, int]] | None = None, cache: dict | None = None,
                 power_of_two_hosts: bool = False, workers: int = 1) -> StageSearch:
    """Slice a training step into pipeline stages on sub-meshes of a (hosts x devices per host)
    `mesh` (a `Mesh` or its shape; a `Mesh` on a cluster brings its own). `stages` 0 lets the
    DP choose; `layers` 0 clusters into the model's blocks plus one. `limits`: each stage's
    memory per device (None: no limit; each layer's ILP is solved without one, the DP bounds
    the stage's sum) and each layer ILP solve's seconds (default: the cluster's memory per
    device, 30 s). The DP runs on Eq. 6's layers, on them with each block-long layer cut once
    more (FINER) or only those next to the first plan's stage ends (LOCAL), and on as many
    layers of equal op counts (when `_affordable`); the fastest plan is kept
    (`StageSearch.clustering` says whose).

    For baselines under the same cost model: `forward_layers` (op index ranges of the forward,
    in order) replaces the clustering; `families` are the ways a stage may be sharded, each
    across the whole stage (None: the ILP; a name: that hand plan of
    `graphpar.passes.autoshard.hand_plans` on every layer it applies to, the ILP on the rest);
    `logical` chooses the logical meshes of a sub-mesh shape; `fixed` stages (first layer,
    last layer, index into `submesh_shapes`) replace the DP. `power_of_two_hosts` allows
    multi-host sub-meshes of 2, 4, 8, ... hosts only (fewer ILP solves). `cache` shares layer costs
    between calls on the same graph, cluster, dtype and microbatch count. `workers`: processes
    the layer ILPs of each candidate clustering are solved on (`solve_pool`; the plan is the
    same for any number)."""
    started = time.perf_counter()
    if isinstance(mesh, Mesh):
        mesh, cluster = mesh.shape, mesh.cluster or cluster
    hosts, per_host = _physical(mesh)
    cluster = get_cluster(cluster)
    if microbatches < 1:
        raise PassError(f"microbatches={microbatches}: give at least 1")
    limits = limits or PlanLimits.parse(cluster=cluster)
    # no limit: more than any plan needs, so the Eq. 5 check never binds
    limit = limits.memory_bytes if limits.memory_bytes is not None else 2**62
    forward_set, _, optimizer = forward_backward_optimizer(graph)
    forward = [n for n in graph.nodes if n in forward_set]
    if forward_layers is None:
        count = min(layers or default_layer_count(forward), len(forward))
        regular = regular_clusterings(graph, forward, count, delta,
                                      cuts=1 if fixed is not None else 2)
        candidates = [("eq6", regular[0])]
        if fixed is None:  # fixed stages name the layers of Eq. 6's clustering
            candidates += [(FINER, bounds) for bounds in regular[1:]]
            candidates.append(("equal operator", equal_ranges(len(forward), count)))
    else:
        candidates = [("given", list(forward_layers))]
    count = len(candidates[0][1])
    if stages > count:
        raise PassError(f"stages={stages} is more than the {count} layers graph @{graph.name} "
                        f"was clustered into; ask for at most {count} stages, or for more "
                        "layers (slice-stages{layers=...})")
    if stages > hosts * per_host:
        raise PassError(f"stages={stages} needs at least as many devices; the mesh "
                        f"{hosts}x{per_host} has {hosts * per_host}")
    shapes = submesh_shapes(hosts, per_host, power_of_two_hosts)
    solver = _LayerCosts(graph, cluster, dtype, limits.time_seconds, microbatches, forward_set,
                         optimizer, cache, workers)
    clusterings = _affordable([_Clustered.of(graph, name, bounds, forward, forward_set)
                               for name, bounds in candidates])
    clustered = time.perf_counter()
    costing = searching = 0.0
    best = None
    for c in clusterings:
        begun = time.perf_counter()
        meshes = logical
        if c.name in (FINER, LOCAL) and clusterings[0].solution is not None:
            meshes = _stage_sized(clusterings[0], microbatches)
        c.options = _StageOptions.build(c.units, solver, shapes, hosts, per_host, cluster,
                                        _boundary_bytes(graph, c.layer_of, len(c.bounds)),
                                        meshes, families)
        c.costs, c.chosen = c.options.table(limit, microbatches)
        costed = time.perf_counter()
        if fixed is not None:
            c.solution = evaluate_stages(c.costs, fixed, microbatches)
            if c.solution is None:
                raise MemoryLimitError(f"the fixed stages {list(fixed)} do not fit "
                                       f"{format_bytes(limit)} per device")
        else:
            # a later candidate is kept only if strictly faster (ties go to the earlier one),
            # so its DP may stop as soon as it cannot beat the best plan so far
            beat = best.solution.seconds if best is not None else np.inf
            c.solution = solve_stages(c.costs, hosts * per_host, microbatches, stages, epsilon,
                                      beat=beat)
        costing, searching = costing + costed - begun, searching + time.perf_counter() - costed
        # ties go to the earlier candidate: Eq. 6's clustering
        if c.solution is not None and (best is None
                                       or c.solution.seconds < best.solution.seconds):
            best = c
        # LOCAL cuts next to Eq. 6's plan's stage ends, so it can only be made once that plan
        # is known: it joins the list after FINER, ahead of this loop, which reaches it
        if c is clusterings[0] and c.solution is not None:
            finer = next((f for f in clusterings if f.name == FINER), None)
            if finer is not None:
                bounds = _split_at_stage_ends(c, finer)
                clusterings.insert(clusterings.index(finer) + 1, _Clustered.of(
                    graph, LOCAL, bounds, forward, forward_set))
    if best is None:
        raise _no_plan(clusterings[0].options, hosts * per_host, microbatches, stages, epsilon,
                       limit, solver)
    options, costs, chosen, solution = best.options, best.costs, best.chosen, best.solution
    units, layer_of, forward_layers = best.units, best.layer_of, best.bounds

    placed = place_submeshes([shapes[m] for _, _, m in solution.stages], hosts, per_host)
    result, families_used = [], []
    stage_of_layer = {}
    for s, ((a, b, m), devices) in enumerate(zip(solution.stages, placed)):
        g = chosen[a, b, m]
        lshape, family = options.choices[m][g]
        families_used.append(family)
        persistent, stashed = options.persistent[a, b, m, g], options.stashed[a, b, m, g]
        in_flight = min(len(solution.stages) - s, microbatches)
        modules = sorted({n.module for u in units[a:b + 1] for n in u.forward if n.module})
        result.append(PipelineStage(
            layers=tuple(range(a, b + 1)), modules=tuple(modules), submesh=shapes[m],
            logical_mesh=lshape, est_seconds=float(costs.seconds[a, b, m]),
            mem_bytes=int(persistent + in_flight * stashed), devices=devices))
        stage_of_layer.update({layer: s for layer in range(a, b + 1)})
    plan = StagePlan(
        stages=tuple(result),
        stage_of=MappingProxyType({n: stage_of_layer[layer_of[n]] for n in graph.nodes}),
        microbatches=microbatches, est_step_seconds=solution.seconds,
        dp_seconds=time.perf_counter() - started, ilp_solves=solver.solves,
        layer_solves=solver.outcomes)
    steps = {"clustering": clustered - started, "layer_costs": costing, "dp": searching}
    return StageSearch(plan, costs, tuple(families_used), list(forward_layers), steps,
                       best.name)


def _units(graph: Graph, layer_of: dict[Node, int], count: int, forward: set[Node],
           layering: str = "") -> list[_Layer]:
    """The layers as units to cost. Two layers share an ILP solve when their signatures are
    equal; a layer that returns a value of the graph (the model's output) is told apart from
    an identical one that only passes it on, since the returned value's layout is priced."""
    members: list[list[Node]] = [[] for _ in range(count)]
    for node in graph.nodes:
        members[layer_of[node]].append(node)
    members = [canonical_order(nodes) for nodes in members]  # identical layers list alike
    returned = {o.value for o in graph.outputs
                if o.role is OutputRole.OUTPUT and o.target is None}
    units = []
    for i, nodes in enumerate(members):
        marks = [(k, o.index) for k, n in enumerate(nodes) for o in n.outputs if o in returned]
        signature = layer_signature(nodes) + (f" returns {marks}" if marks else "")
        units.append(_Layer(i, nodes, [n for n in nodes if n in forward], signature,
                            layering))
    return units


def evaluate_stages(costs: StageCosts, stages: Sequence[tuple[int, int, int]],
                    microbatches: int) -> StageSolution | None:
    """The cost of given stages (first layer, last layer, sub-mesh shape index) on the DP's
    table, or None when one cannot run or does not fit with the stages after it."""
    times = []
    for s, (a, b, m) in enumerate(stages):
        fits = costs.max_after[a, b, m] >= len(stages) - 1 - s
        if not (fits and np.isfinite(costs.seconds[a, b, m])):
            return None
        times.append(float(costs.seconds[a, b, m]))
    return StageSolution(tuple(stages), pipeline_seconds(times, microbatches), 0)


def _physical(mesh: str | Sequence[int]) -> tuple[int, int]:
    shape = parse_mesh_shape(mesh)
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2:
        raise ShardingError(f"slice-stages needs the physical mesh as hosts x devices per host "
                            f"(e.g. 2x8), got {'x'.join(map(str, shape))}")
    return shape


UNBOUNDED = 1 << 30  # any number of stages may follow


def max_after(persistent: np.ndarray, stashed: np.ndarray, limit: float,
              microbatches: int) -> np.ndarray:
    """Eq. 5 with 1F1B's in-flight count, elementwise: a stage followed by `a` stages keeps
    min(a + 1, B) microbatches' activations. The most stages that may follow, or -1 where the
    stage does not fit even last."""
    with np.errstate(divide="ignore", invalid="ignore"):
        in_flight = np.floor((limit - persistent) / stashed)
    in_flight = np.where(stashed > 0, in_flight, np.inf)
    after = np.where(in_flight >= microbatches, UNBOUNDED,
                     np.minimum(in_flight, UNBOUNDED) - 1).astype(np.int64)
    return np.where(persistent + stashed > limit, -1, after)


@dataclass
class _StageOptions:
    """Every layer range on every (sub-mesh, logical mesh and family): seconds per microbatch
    (sending its boundary included) and bytes per device, as [L, L, shapes, choices] arrays
    (inf seconds where a choice does not exist or has no plan)."""

    shapes: tuple[tuple[int, int], ...]
    choices: list[list[tuple[tuple[int, int], str | None]]]  # per shape: (logical mesh, family)
    seconds: np.ndarray
    persistent: np.ndarray
    stashed: np.ndarray

    @classmethod
    def build(cls, units: list[_Layer], solver: _LayerCosts, shapes, hosts: int, per_host: int,
              cluster: Cluster, boundary: np.ndarray, logical: LogicalMeshes,
              families: Sequence[str | None]) -> _StageOptions:
        choices = [[(lshape, family) for lshape in logical(shape) for family in families]
                   for shape in shapes]
        count, most = len(units), max(max(len(c) for c in choices), 1)
        seconds = np.full((count, count, len(shapes), most), np.inf)
        persistent = np.zeros(seconds.shape)
        stashed = np.zeros(seconds.shape)
        crossings = _crossings(units)
        solver.prefetch([(u, mesh_for(lshape, cluster), family, shape)
                         for m, shape in enumerate(shapes)
                         for lshape, family in choices[m] for u in units])
        for m, shape in enumerate(shapes):
            send = np.array([_send_seconds(boundary[j], shape, hosts, per_host, cluster)
                             if j < count - 1 else 0.0 for j in range(count)])
            for g, (lshape, family) in enumerate(choices[m]):
                table = _range_costs(units, solver, mesh_for(lshape, cluster), family, shape,
                                     crossings)
                if table is not None:
                    seconds[:, :, m, g] = table[0] + send[None, :]
                    persistent[:, :, m, g], stashed[:, :, m, g] = table[1], table[2]
        return cls(tuple(shapes), choices, seconds, persistent, stashed)

    def table(self, limit: float, microbatches: int) -> tuple[StageCosts, np.ndarray]:
        """The DP's table under a per-device memory limit: per (range, sub-mesh) the fastest
        logical mesh that fits as the last stage, and how many stages may follow it then; and
        which logical mesh that is."""
        fits = max_after(self.persistent, self.stashed, limit, microbatches)
        fits[~np.isfinite(self.seconds)] = -1
        seconds = np.where(fits >= 0, self.seconds, np.inf)
        logical = np.argmin(seconds, axis=3)
        pick = logical[..., None]
        best = np.take_along_axis(seconds, pick, axis=3)[..., 0]
        after = np.take_along_axis(fits, pick, axis=3)[..., 0]
        after[~np.isfinite(best)] = -1
        return StageCosts(best, after, self.shapes), logical


class _LayerCosts:
    """The ILP cost of each layer on each logical mesh, one solve per (layer structure, mesh);
    `outcomes` counts the solves by outcome (optimal, time limit, no plan), so a layer whose
    solve gave no plan, and so ruled its logical mesh out of the DP, is reported, not
    silently dropped. `prefetch` solves many at once on `workers` processes."""

    def __init__(self, graph: Graph, cluster: Cluster, dtype: str, time_limit: float,
                 microbatches: int, forward: set[Node], optimizer: set[Node],
                 cache: dict | None = None, workers: int = 1):
        self.graph, self.cluster, self.time_limit = graph, cluster, time_limit
        self.roofline = Roofline.of(cluster, dtype)
        self.microbatches, self.forward, self.optimizer = microbatches, forward, optimizer
        self.workers = workers
        # a training step keeps each weight's gradient beside it; an inference graph does not
        self.gradients = any(o.role is OutputRole.LOSS for o in graph.outputs)
        self.solves = 0
        self.outcomes = LayerSolves()  # this object's solves (not those found in `cache`)
        self._found: dict[tuple, LayerCost | None] = {} if cache is None else cache
        self._tables: dict = {}  # resharding cost tables, shared by the solves on one mesh

    @staticmethod
    def _key(layer: _Layer, mesh: Mesh, family: str | None) -> tuple:
        return (layer.signature, mesh.shape, mesh.bandwidth, mesh.latency, family)

    def cost(self, layer: _Layer, mesh: Mesh, family: str | None,
             submesh: tuple[int, int] | None = None) -> LayerCost | None:
        """The layer's cost on `mesh` (a logical mesh of `submesh`, which only names it in
        reports), or None when its solve gave no plan."""
        key = self._key(layer, mesh, family)
        if key not in self._found:
            self._keep(key, self._solve(layer, mesh, family, submesh))
        return self._found[key]

    def prefetch(self, wanted: Sequence[tuple[_Layer, Mesh, str | None, tuple[int, int]]]
                 ) -> None:
        """Solve every (layer, logical mesh, family, sub-mesh) of `wanted` not solved yet, on
        up to `workers` processes; counted in the order given, as `cost` would one by one."""
        todo: dict[tuple, tuple] = {}
        for layer, mesh, family, submesh in wanted:
            key = self._key(layer, mesh, family)
            if key not in self._found and key not in todo:
                todo[key] = (layer, mesh, family, submesh)
        asked = list(todo.values())
        results = map_in_order(lambda i: self._solve(*asked[i]), len(asked), self.workers)
        for key, result in zip(todo, results):
            self._keep(key, result)

    def _keep(self, key: tuple, result: tuple) -> None:
        cost, outcome, example = result
        self.solves += 1
        self.outcomes = self.outcomes.add(outcome, example)
        self._found[key] = cost

    def _solve(self, layer: _Layer, mesh: Mesh, family: str | None,
               submesh: tuple[int, int] | None = None
               ) -> tuple[LayerCost | None, str, LayerSolve | None]:
        """(the layer's cost or None, the solve's outcome, and for an outcome but optimal
        where and why)."""
        def example(outcome: str, message: str) -> LayerSolve:
            modules = tuple(dict.fromkeys(n.module for n in layer.forward if n.module))
            return LayerSolve(outcome, layer.index, layer.layering, modules, submesh,
                              tuple(mesh.shape), family, message)

        sub = stage_subgraph(self.graph, layer.nodes, f"layer{layer.index}", keep_order=True)
        costed = _without_boundary_outputs(sub)
        reduced = Reduced(Problem(costed, mesh, self.roofline, tables=self._tables))
        try:
            plan = None
            if family is not None:
                try:
                    plan = hand_plan(reduced, family, None, self.time_limit)
                except NotApplicable:  # e.g. no Megatron linears in this layer: the ILP plans it
                    pass
            plan = plan or reduced.solve(None, self.time_limit)
        except ShardingError as error:
            outcome = ("time_limit_no_plan" if isinstance(error, TimeLimitError) else
                       "infeasible" if isinstance(error, MemoryLimitError) else "failed")
            return None, outcome, example(outcome, str(error))
        status = plan.stats.get("status")
        outcome, found = "optimal", None
        if status != "OPTIMAL":  # FEASIBLE: the solver stopped at its time limit
            gap = plan.stats.get("optimality_gap", float("nan"))
            gap = f"{gap:.1%}" if gap == gap else "unknown"
            outcome = "time_limit_not_proven_optimal"
            found = example(outcome, f"solver status {status}, optimality gap {gap} when the "
                                     f"{self.time_limit:g} s time limit ran out")
        nodes = list(costed.nodes)
        update = sum(plan.node_strategy[n].compute_seconds
                     for n, orig in zip(nodes, layer.nodes) if orig in self.optimizer)
        seconds = plan.step_seconds - update + update / self.microbatches
        persistent = 0
        for v in costed.inputs:
            if v.role in PERSISTENT_ROLES:
                per = plan.input_layout[v].local_bytes(v.type.shape, v.type.itemsize, mesh)
                persistent += per * (2 if v.role is Role.PARAM and self.gradients else 1)
        stashed = 0
        for n, orig in zip(nodes, layer.nodes):
            if orig not in self.forward:
                continue
            for out, orig_out in zip(n.outputs, orig.outputs):
                if any(u not in self.forward for u in orig_out.users):  # the backward reads it
                    layout = plan.node_strategy[n].outputs[out.index]
                    stashed += layout.local_bytes(out.type.shape, out.type.itemsize, mesh)
        results = tuple(tuple(plan.node_strategy[n].outputs) for n in nodes)
        inputs = tuple(plan.input_layout[v] if v.role is Role.INPUT else None
                       for v in costed.inputs)
        return LayerCost(seconds, persistent, stashed, results, inputs), outcome, found


def _without_boundary_outputs(sub: Graph) -> Graph:
    """The layer's subgraph without the plain outputs that carry values to other layers: their
    layout is free here (the next layer's plan, or the cross-stage send, decides it), where
    the ILP would otherwise price gathering them whole for a user."""
    costed = sub.copy()
    costed.outputs = [o for o in costed.outputs
                      if not (o.role is OutputRole.OUTPUT and o.target is not None)]
    return costed


def _range_costs(units: list[_Layer], solver: _LayerCosts, mesh: Mesh, family: str | None,
                 submesh: tuple[int, int] | None = None,
                 crossings: list[_Crossing] | None = None):
    """(seconds, persistent bytes, stashed bytes) of every layer range i..j on `mesh` (a
    logical mesh of `submesh`), as [L, L] arrays, or None when some layer has no plan on it
    (`solver.outcomes` counts why). The seconds include resharding between the layers' plans
    inside the range."""
    count = len(units)
    per = [solver.cost(u, mesh, family, submesh) for u in units]
    if any(c is None for c in per):
        return None
    # pair[p, c]: from layer p's plan to layer c's
    pair = _reshard_between(units, per, mesh, crossings)
    t = np.array([c.seconds for c in per])
    persistent = np.array([c.persistent_bytes for c in per], dtype=np.float64)
    stashed = np.array([c.stashed_bytes for c in per], dtype=np.float64)
    seconds = np.full((count, count), np.inf)
    mem_p = np.zeros((count, count))
    mem_s = np.zeros((count, count))
    for i in range(count):
        run, inside, mp, ms = 0.0, 0.0, 0.0, 0.0
        for j in range(i, count):
            run += t[j]
            inside += pair[i:j, j].sum() + pair[j, i:j].sum()
            mp += persistent[j]
            ms += stashed[j]
            seconds[i, j], mem_p[i, j], mem_s[i, j] = run + inside, mp, ms
    return seconds, mem_p, mem_s


@dataclass(frozen=True)
class _Crossing:
    """A value layer `p` makes and layer `c` reads: made by the `node`-th node of p (in
    `canonical_order`, as p's stage subgraph lists them) as its `output`-th result, read as
    the `read`-th input of c's stage subgraph."""

    p: int
    c: int
    value: Value
    node: int
    output: int
    read: int


def _crossings(units: list[_Layer]) -> list[_Crossing]:
    """Every value passed from one layer to another, found once per clustering: the walk over
    the graph does not depend on the mesh, only the layouts read off each plan do."""
    made: dict[Value, tuple[int, int, int]] = {}
    for p, u in enumerate(units):
        for k, node in enumerate(u.nodes):
            for out in node.outputs:
                made[out] = (p, k, out.index)
    found = []
    for c, u in enumerate(units):
        members = set(u.nodes)
        seen: set[Value] = set()
        for node in u.nodes:  # the subgraph's inputs, in the order `stage_subgraph` makes them
            for v in node.input_values:
                if v.producer in members or v in seen:
                    continue
                seen.add(v)
                if v in made and made[v][0] != c:
                    p, k, index = made[v]
                    found.append(_Crossing(p, c, v, k, index, len(seen) - 1))
    return found


def _reshard_between(units: list[_Layer], per: list[LayerCost], mesh: Mesh,
                     crossings: list[_Crossing] | None = None) -> np.ndarray:
    """pair[p, c]: seconds to reshard what layer p sends layer c, from the layout p's plan
    gives it to the layout c's plan reads it in (same logical mesh). Identical layers repeat
    the same (shape, layouts) resharding, which is priced once."""
    count = len(units)
    pair = np.zeros((count, count))
    priced: dict[tuple, float] = {}
    for x in crossings if crossings is not None else _crossings(units):
        dst = per[x.c].input_layouts[x.read]
        if dst is None:  # not an activation of the reading layer's subgraph
            continue
        src = per[x.p].result_layouts[x.node][x.output]
        if src != dst:
            shape, itemsize = x.value.type.shape, x.value.type.itemsize
            key = (shape, itemsize, src, dst)
            if key not in priced:
                priced[key] = resharding_cost(shape, itemsize, src, dst, mesh).seconds
            pair[x.p, x.c] += priced[key]
    return pair


def _boundary_bytes(graph: Graph, layer_of: dict[Node, int], count: int) -> np.ndarray:
    """Bytes crossing the cut after each layer: values produced on one side and read on the
    other (forward activations and backward gradients alike), each counted once per cut."""
    crossing = np.zeros(count + 1)
    for node in graph.nodes:
        p = layer_of[node]
        for out in node.outputs:
            readers = [layer_of[u] for u in out.users]
            if not readers:
                continue
            low, high = min(readers + [p]), max(readers + [p])
            if low < high:  # crosses every cut from low to high - 1
                crossing[low] += out.type.nbytes
                crossing[high] -= out.type.nbytes
    return np.cumsum(crossing)[:count]


def _send_seconds(nbytes: float, shape: tuple[int, int], hosts: int, per_host: int,
                  cluster: Cluster) -> float:
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = _sending_bandwidth(shape, hosts, per_host, cluster)
    return latency + nbytes / bandwidth


def _sending_bandwidth(shape: tuple[int, int], hosts: int, per_host: int,
                       cluster: Cluster) -> tuple[float, float]:
    """(bytes/s, latency) from a sub-mesh to the next stage's: on one host, over its devices'
    intra-node links; on several, over the sub-mesh's share of the NICs (a whole host has all
    of one host's; a part of a host its devices' share), since the next stage may sit on
    another host."""
    n, m = shape
    if hosts == 1:
        return m * cluster.intra_node_bandwidth, cluster.intra_node_latency
    share = n * cluster.inter_node_bandwidth * m / per_host
    return share, cluster.inter_node_latency


def _no_plan(options: _StageOptions, devices: int, microbatches: int, stages: int,
             epsilon: float, limit: int, solver: _LayerCosts | None = None) -> ShardingError:
    """The error when no pipeline fits: every layer's solve out of time (the time limit to
    raise), or how much memory per device the leanest pipeline needs (the least limit under
    which the DP finds a plan, by bisection)."""
    what = f"{stages} stages" if stages else "any number of stages"
    finite = np.isfinite(options.seconds)
    counts = solver.outcomes.counts if solver is not None else {}
    if counts and not any(counts[k] for k in PLANNED) and counts["time_limit_no_plan"]:
        return TimeLimitError(
            f"no stage could be priced: every one of the {solver.outcomes.counted} layer ILP "
            f"solves (counted) hit the time limit of {solver.time_limit:g} s before any plan; "
            "raise --time-limit (slice-stages{time_limit=...} when the pass is given in "
            "--passes)")
    if not finite.any():
        return ShardingError(f"no layer range can be sharded on any sub-mesh of {devices} "
                             "devices; check the mesh divides the model's dimensions")
    high = float((options.persistent + microbatches * options.stashed)[finite].max())
    if solve_stages(options.table(high, microbatches)[0], devices, microbatches, stages,
                    epsilon) is None:
        return ShardingError(f"no pipeline of {what} covers exactly {devices} devices with "
                             "the allowed sub-meshes; choose another number of stages")
    low = float(limit)
    while high - low > max(1.0, 1e-3 * high):
        middle = (low + high) / 2
        found = solve_stages(options.table(middle, microbatches)[0], devices, microbatches,
                             stages, epsilon)
        low, high = (low, middle) if found is not None else (middle, high)
    return MemoryLimitError(
        f"no pipeline of {what} on {devices} devices fits {format_bytes(limit)} per device: "
        f"the leanest one needs about {format_bytes(high)} per device on its fullest stage "
        f"(weights, gradients, optimizer state and {microbatches} microbatches' activations "
        "at most). Use more devices, a larger --memory-limit (slice-stages{memory_limit=...} "
        "when the pass is given in --passes), or more, smaller --microbatches.")


@register_pass("slice-stages")
@dataclass
class SliceStages(GraphPass):
    """Slice a training step into pipeline stages on sub-meshes (Alpa's inter-op pass); the
    result is `ctx.result(StagePlan)`; the IR is not changed. As auto-shard's, its mesh and
    limits come as objects or as text that is read once, when the pass is made."""

    # the physical mesh: hosts x devices per host; text ("2x8") is laid on `cluster`
    mesh: Mesh | str = "1x8"
    cluster: Cluster | str = "dgx-a100"  # for a mesh given as text; then the mesh's
    stages: str = "auto"  # auto, or a number of stages
    microbatches: int = 4
    layers: int = 0  # 0: the model's blocks plus one
    delta: float = DEFAULT_DELTA
    epsilon: float = 1e-6
    # bytes per device of each stage (None: no limit), or as auto-shard's text: "device"
    # (the cluster's memory per device), "none" or a size
    memory_limit: float | str | None = DEFAULT_MEMORY
    dtype: str = "fp32"
    time_limit: float = DEFAULT_TIME_SECONDS  # per ILP solve
    power_of_two_hosts: bool = False  # multi-host sub-meshes of 2, 4, 8 ... hosts only
    workers: int = 0  # processes for the layer ILPs (0: as many as this process' CPUs)

    def __post_init__(self) -> None:
        _physical(self.mesh.shape if isinstance(self.mesh, Mesh) else self.mesh)
        self.mesh = mesh_for(self.mesh, self.cluster)
        self.cluster = self.mesh.cluster
        self.cluster.peak_flops(self.dtype)
        self._stages()
        limits = PlanLimits.parse(self.memory_limit, self.time_limit, self.cluster)
        self.memory_limit, self.time_limit = limits.memory_bytes, limits.time_seconds
        if self.microbatches < 1:
            raise PassError(f"microbatches={self.microbatches}: give at least 1")
        if self.layers < 0:
            raise PassError(f"layers={self.layers}: give a positive number, or 0 for auto")
        if self.workers < 0:
            raise PassError(f"workers={self.workers}: give a positive number, or 0 for as many "
                            "as this process may use CPUs")

    @classmethod
    def of(cls, mesh: Mesh, limits: PlanLimits, **options) -> SliceStages:
        """The pass for the physical `mesh` (on its cluster) under `limits`; `options` are the
        other fields."""
        return cls(mesh=mesh, memory_limit=limits.memory_bytes,
                   time_limit=limits.time_seconds, **options)

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(self.memory_limit, self.time_limit)

    def _stages(self) -> int:
        if str(self.stages) == "auto":
            return 0
        try:
            value = int(self.stages)
        except ValueError:
            value = 0
        if value < 1:
            raise PassError(f"stages={self.stages!r}: give 'auto' or a positive number")
        return value

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        search = slice_stages(
            graph, self.mesh, self.cluster, self.microbatches, self._stages(), self.layers,
            self.delta, self.epsilon, self.limits, self.dtype,
            power_of_two_hosts=self.power_of_two_hosts,
            workers=self.workers or available_workers())
        ctx.set_result(search.plan)
        return False


class ServingStages:
    """An inference graph's layers costed for serving by the same machinery: the clustering
    into layers (Eq. 6), one auto-shard ILP solve per (layer structure, logical mesh), the
    resharding between consecutive layers' plans and the send of a stage's boundary. Serving
    placement (`graphpar.placement.configs`) asks it for the cost of every layer range as one
    stage on a sub-mesh and runs its own DP (the slowest stage, not a training pipeline's
    step). `cache` shares ILP solves between graphs whose layers have the same structure (two
    models of one shape)."""

    def __init__(self, graph: Graph, cluster: str | Cluster = "dgx-a100", dtype: str = "fp16",
                 layers: int = 0, delta: float = DEFAULT_DELTA, time_limit: float = 30.0,
                 cache: dict | None = None, logical: LogicalMeshes = logical_meshes):
        if any(o.role is OutputRole.LOSS for o in graph.outputs):
            raise PassError(f"graph @{graph.name} is a training step; serving stages are cut "
                            "from an inference graph (capture without --mode train)")
        self.cluster = get_cluster(cluster)
        self.logical = logical
        nodes = list(graph.nodes)
        count = min(layers or default_layer_count(nodes), len(nodes))
        self.layers = cluster_bounds(forward_chain(nodes), count, delta)
        layer_of = {nodes[k]: i for i, (a, b) in enumerate(self.layers)
                    for k in range(a, b + 1)}
        self.units = _units(graph, layer_of, len(self.layers), set(nodes))
        self.solver = _LayerCosts(graph, self.cluster, dtype, time_limit, 1, set(nodes), set(),
                                  cache)
        self.boundary = _boundary_bytes(graph, layer_of, len(self.layers))

    def layer_seconds(self, mesh: Mesh) -> np.ndarray:
        """Each layer's ILP objective (compute + communication, seconds, estimated) alone on
        `mesh`: on one device, each layer's compute."""
        costs = [self.solver.cost(u, mesh, None) for u in self.units]
        return np.array([np.inf if c is None else c.seconds for c in costs])

    def ranges(self, shape: tuple[int, int], hosts: int) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, weight bytes per device) of every layer range i..j run as one stage on a
        sub-mesh of `shape` (hosts x devices), as [L, L] arrays: the fastest logical mesh's
        plan, the resharding inside the range, and (for j before the last layer) the send of
        the boundary to the next stage of a group spanning `hosts` hosts. Seconds are inf
        where no logical mesh has a plan."""
        options = _StageOptions.build(self.units, self.solver, (shape,), hosts,
                                      self.cluster.devices_per_node, self.cluster,
                                      self.boundary, self.logical, (None,))
        costs, chosen = options.table(float(UNBOUNDED) ** 2, 1)
        weights = np.take_along_axis(options.persistent[:, :, 0], chosen[:, :, 0, None],
                                     axis=2)[..., 0]
        return costs.seconds[:, :, 0], weights
