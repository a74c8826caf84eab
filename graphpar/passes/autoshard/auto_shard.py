"""The `auto-shard` pass: solve Alpa's intra-operator ILP for a graph, then write the plan into it
(`graphpar.passes.autoshard.apply`) and hand the plan on as a typed result (`ShardingPlans`)."""

from __future__ import annotations

from dataclasses import dataclass

from graphpar.cost.cluster import mesh_for
from graphpar.cost.compute import Roofline
from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS, PlanLimits
from graphpar.errors import ShardingError
from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import Graph
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import OpKind, get_op
from graphpar.passes.autoshard import ilp
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.hand_plans import HAND_PLANS, hand_plan
from graphpar.passes.autoshard.ilp import Deadline, Plan, Reduced
from graphpar.passes.autoshard.strategies import node_strategies
from graphpar.passes.manager import GraphPass, PassContext, register_pass


class ShardingPlans(dict[str, Plan]):
    """auto-shard's result: the solved plan of each graph, by graph name."""


def _check_mesh_divides(graph: Graph, mesh: Mesh) -> None:
    """A mesh on which no heavy op can be split is a user error, not a plan."""
    heavy = [n for n in graph.nodes if get_op(n.op).kind in (OpKind.MATMUL, OpKind.COMPOSITE)]
    if mesh.size == 1 or not heavy:
        return
    if any(len(node_strategies(n, mesh, 1.0)) > 1 for n in heavy):
        return
    sizes = sorted({d for n in heavy for o in n.outputs for d in o.type.shape if d > 1})
    raise ShardingError(
        f"mesh {mesh} divides no dimension of graph @{graph.name} usefully: no matmul, "
        f"attention, norm or convolution can be split along any of its axes "
        f"({' x '.join(map(str, mesh.shape))}). Dimension sizes in the graph: "
        f"{', '.join(map(str, sizes[:12]))}{' ...' if len(sizes) > 12 else ''}. Choose mesh "
        "axis sizes that divide the batch, hidden size or number of heads.")


@register_pass("auto-shard")
@dataclass
class AutoShard(GraphPass):
    """Choose a layout for every value by Alpa's ILP (OR-Tools) and mark reshards.

    Its options come as objects (`AutoShard.of(mesh, limits)`) or as text from a pipeline
    string (`auto-shard{mesh=2x4,memory_limit=40GB}`): text is read once, when the pass is
    made, and the fields hold the objects from then on."""

    # the mesh to plan on; text ("2x4") is laid on `cluster` (`mesh_for`)
    mesh: Mesh | str = "1x4"
    # the cluster a mesh given as text is laid on (a `Mesh` brings its own); then the mesh's
    cluster: Cluster | str = "dgx-a100"
    # bytes per device (None: no limit), or as text: "device" (the cluster's memory per
    # device, a plan a user can run), "none" (the solver then replicates weights freely) or a
    # size like "40GB"
    memory_limit: float | str | None = DEFAULT_MEMORY
    time_limit: float = DEFAULT_TIME_SECONDS  # seconds for the whole pass: build and solve
    dtype: str = "fp32"
    # the runtime will all-reduce gradients in buckets of about this many bytes (a
    # `graphpar train` rank): price them so (`ilp.Problem`); None: one by one
    bucket_bytes: int | None = None
    # "auto": the ILP's cheapest plan; or a hand plan's name (hand_plans.HAND_PLANS): the
    # cheapest plan its rules allow, solved by the same ILP
    plan: str = "auto"

    def __post_init__(self) -> None:
        """Bad options fail when the pass is made (a pipeline string is parsed), not after the
        model is captured."""
        self.mesh = mesh_for(self.mesh, self.cluster)
        self.cluster = self.mesh.cluster
        self.cluster.peak_flops(self.dtype)
        if self.plan != "auto" and self.plan not in HAND_PLANS:
            raise ShardingError(f"unknown plan {self.plan!r}; choose auto or a "
                                f"hand plan: {', '.join(HAND_PLANS)}")
        limits = PlanLimits.parse(self.memory_limit, self.time_limit, self.cluster)
        self.memory_limit, self.time_limit = limits.memory_bytes, limits.time_seconds

    @classmethod
    def of(cls, mesh: Mesh, limits: PlanLimits, dtype: str = "fp32",
           bucket_bytes: int | None = None, plan: str = "auto") -> AutoShard:
        """The pass for `mesh` (on its cluster) under `limits`, solving for `plan`."""
        return cls(mesh=mesh, memory_limit=limits.memory_bytes, time_limit=limits.time_seconds,
                   dtype=dtype, bucket_bytes=bucket_bytes, plan=plan)

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(self.memory_limit, self.time_limit)

    def solve(self, graph: Graph) -> tuple[Reduced, Plan]:
        """The reduced ILP of `graph` under these options and its cheapest plan, both within
        the time limit (`graphpar explain` re-solves the same ILP)."""
        deadline = Deadline(self.time_limit)  # the limit covers the whole pass, not the solver
        if graph.mesh is not None:
            raise ShardingError(f"graph @{graph.name} is already sharded on mesh {graph.mesh}")
        _check_mesh_divides(graph, self.mesh)
        roofline = Roofline.of(self.cluster, self.dtype)
        if self.plan == "auto":
            return ilp.solve(graph, self.mesh, roofline, self.limits, deadline=deadline,
                             bucket_bytes=self.bucket_bytes)
        reduced = ilp.build_reduced(graph, self.mesh, roofline, deadline,
                                    bucket_bytes=self.bucket_bytes)
        return reduced, hand_plan(reduced, self.plan, self.memory_limit,
                                  time_limit=max(deadline.left(), 1e-3))

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        reduced, plan = self.solve(graph)
        mesh = reduced.problem.mesh
        reshards = shard_graph(graph, mesh, plan)
        graph.attrs.update({
            "estimated_compute_s": round(plan.compute_seconds, 9),
            "estimated_comm_s": round(plan.comm_seconds, 9),
            "estimated_memory_bytes": int(plan.memory_bytes),
            "reshards": reshards,
        })
        ctx.result(ShardingPlans)[graph.name] = plan
        return True
