"""Writing a sharding plan into the IR: layouts on values, `reshard` nodes where they change.

Every value gets its layout; wherever a consumer needs another layout than its operand has, an
explicit `reshard` node stands between them (global semantics: the identity), so the plan reads
in the IR text and `lower-spmd` turns each reshard into collectives.
"""

from __future__ import annotations

from graphpar.ir.graph import Graph, Node, OutputRole, Value
from graphpar.ir.layout import Layout
from graphpar.ir.mesh import Mesh
from graphpar.passes.autoshard.ilp import Plan
from graphpar.passes.autoshard.strategies import replicated


def shard_graph(graph: Graph, mesh: Mesh, plan: Plan) -> int:
    """Write `plan` into `graph`: layouts on values, `reshard` nodes where layouts change, and
    the mesh on the graph. Returns how many reshard nodes were inserted."""
    graph.mesh = mesh
    for v, layout in plan.input_layout.items():
        v.layout = layout
    for node, strategy in plan.node_strategy.items():
        for out, layout in zip(node.outputs, strategy.outputs):
            out.layout = layout
    inserted: dict[tuple[Value, Layout], Value] = {}

    def resharded(value: Value, layout: Layout, before: Node | None) -> Value:
        key = (value, layout)
        if key not in inserted:
            node = graph.create("reshard", [value], module=_module(value), before=before,
                                output_types=[value.type])
            node.output.layout = layout
            inserted[key] = node.output
        return inserted[key]

    for node in list(graph.nodes):
        strategy = plan.node_strategy.get(node)
        if strategy is None:
            continue
        for i, v in enumerate(node.inputs):
            need = strategy.inputs[i]
            if isinstance(v, Value) and need is not None and v.layout != need:
                node.replace_input(v, resharded(v, need, node))
    full = replicated(mesh)
    state = graph.inputs_by_name()
    for out in graph.outputs:
        if out.role in (OutputRole.UPDATE, OutputRole.GRAD):
            need = state[out.target].layout
        else:
            need = full
        if out.value.layout != need:
            out.value = resharded(out.value, need, None)
    return len(inserted)


def _module(value: Value) -> str | None:
    return value.producer.module if value.producer is not None else None
