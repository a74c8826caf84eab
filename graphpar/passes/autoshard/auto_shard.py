"""The `auto-shard` pass: solve Alpa's intra-operator ILP for a graph, then write the plan into it
(`graphpar.passes.autoshard.apply`) and hand the plan on as a typed result (`ShardingPlans`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import OpKind, get_op
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.ilp import Deadline, Plan, Reduced, build_reduced
from graphpar.passes.autoshard.strategies import node_strategies
from graphpar.passes.manager import GraphPass, PassContext, register_pass
from graphpar.units import parse_bytes


class ShardingPlans(dict[str, Plan]):
    """auto-shard's result: the solved plan of each graph, by graph name."""


def _check_mesh_divides(graph: Graph, mesh: Mesh, text: str) -> None:
    """A mesh on which no heavy op can be split is a user error, not a plan."""
    heavy = [n for n in graph.nodes if get_op(n.op).kind in (OpKind.MATMUL, OpKind.COMPOSITE)]
    if mesh.size == 1 or not heavy:
        return
    if any(len(node_strategies(n, mesh, 1.0)) > 1 for n in heavy):
        return
    sizes = sorted({d for n in heavy for o in n.outputs for d in o.type.shape if d > 1})
    raise ShardingError(
        f"mesh {text} divides no dimension of graph @{graph.name} usefully: no matmul, "
        f"attention, norm or convolution can be split along any of its axes "
        f"({' x '.join(map(str, mesh.shape))}). Dimension sizes in the graph: "
        f"{', '.join(map(str, sizes[:12]))}{' ...' if len(sizes) > 12 else ''}. Choose mesh "
        "axis sizes that divide the batch, hidden size or number of heads.")


@register_pass("auto-shard")
@dataclass
class AutoShard(GraphPass):
    """Choose a layout for every value by Alpa's ILP (OR-Tools) and mark reshards."""

    mesh: str = "1x4"
    cluster: str = "dgx-a100"
    # "device": the cluster's memory per device (a plan a user can run); "none": no limit
    # (the solver then replicates weights freely); or a size like "40GB".
    memory_limit: str = "device"
    time_limit: float = 30.0
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        """Bad options fail when the pass is made (a pipeline string is parsed), not after the
        model is captured."""
        mesh_for(self.mesh, get_cluster(self.cluster)).cluster.peak_flops(self.dtype)
        if self.memory_limit not in ("", "device", "none"):
            parse_bytes(self.memory_limit)
        if not (isinstance(self.time_limit, (int, float)) and math.isfinite(self.time_limit)
                and self.time_limit > 0):
            raise ShardingError(f"time_limit={self.time_limit}: give a positive number of "
                                "seconds")

    def memory_bytes(self, mesh) -> int | None:
        """The per-device limit the plan must meet, in bytes (None: unconstrained)."""
        if self.memory_limit == "none":
            return None
        if self.memory_limit in ("", "device"):
            return mesh.cluster.device_memory
        return parse_bytes(self.memory_limit)

    def solve(self, graph: Graph) -> tuple[Reduced, Plan]:
        """The reduced ILP of `graph` under these options and its cheapest plan, both within
        the time limit (`graphpar explain` re-solves the same ILP)."""
        deadline = Deadline(self.time_limit)  # the limit covers the whole pass, not the solver
        if graph.mesh is not None:
            raise ShardingError(f"graph @{graph.name} is already sharded on mesh {graph.mesh}")
        mesh = mesh_for(self.mesh, get_cluster(self.cluster))
        _check_mesh_divides(graph, mesh, self.mesh)
        reduced = build_reduced(graph, mesh, Roofline.of(mesh.cluster, self.dtype), deadline)
        return reduced, reduced.solve(self.memory_bytes(mesh), max(deadline.left(), 1e-3))

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
