"""`lower-spmd`: a sharded global graph becomes the SPMD program every device of the mesh runs.

Shapes become local (each value's layout applied to its global shape), shape-carrying
attributes follow, and every `reshard` becomes the collectives (and free local steps) that the
cost model planned for it, so the communication the program performs is exactly what the ILP
priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpar.cost.collectives import resharding_cost
from graphpar.errors import PassError
from graphpar.ir.graph import Graph, Node, Program, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import Trait, get_op
from graphpar.ir.verify import describe
from graphpar.passes.autoshard.pass_ import mesh_for
from graphpar.passes.manager import Pass, PassContext, register_pass


def graph_mesh(graph: Graph) -> Mesh:
    if not graph.attrs.get("mesh"):
        raise PassError(f"graph @{graph.name} has no mesh: run auto-shard before lower-spmd")
    return mesh_for(graph.attrs["mesh"], graph.attrs.get("cluster", "dgx-a100"))


def lower_graph(graph: Graph) -> Graph:
    """The SPMD program of a sharded graph (see the module docstring)."""
    from graphpar.ir.collectives import emit_step

    mesh = graph_mesh(graph)
    local = Graph(f"{graph.name}_spmd", attrs={**graph.attrs, "spmd": True})
    mapping: dict[Value, Value] = {}
    for v in graph.inputs:
        new = local.add_input(v.name, _local_type(v, mesh), v.role)
        new.layout = v.layout
        mapping[v] = new
    predicted = 0.0
    for node in graph.nodes:
        if node.op == "reshard":
            (src,) = node.input_values
            cost = resharding_cost(src.type.shape, src.type.itemsize, src.layout,
                                   node.output.layout, mesh)
            current = mapping[src]
            for step in cost.steps:
                current = emit_step(local, step, current, module=node.module, loc=node.loc)
            predicted += cost.bytes
            mapping[node.output] = current
            current.layout = node.output.layout
            continue
        mapping_out = _lower_node(local, node, mapping, mesh)
        for old, new in zip(node.outputs, mapping_out):
            mapping[old] = new
    for out in graph.outputs:
        local.add_output(mapping[out.value], out.role, out.target)
    local.attrs["predicted_bytes_per_device"] = float(predicted)
    return local


def _local_type(value: Value, mesh: Mesh):
    layout = value.layout
    if layout is None:
        return value.type
    return type(value.type)(layout.local_shape(value.type.shape, mesh), value.type.dtype)


def _lower_node(local: Graph, node: Node, mapping: dict, mesh: Mesh) -> tuple[Value, ...]:
    operands = [mapping[v] if isinstance(v, Value) else v for v in node.inputs]
    attrs = dict(node.attrs)
    expected = [_local_type(o, mesh) for o in node.outputs]
    if get_op(node.op).has(Trait.SHAPE_ATTR):  # the attribute spells out the result's shape
        attrs["shape"] = expected[0].shape
    try:
        new = local.create(node.op, operands, attrs, module=node.module, loc=node.loc)
    except TypeError as exc:
        raise PassError(f"lower-spmd: {describe(node)} does not run on local shards: {exc}"
                        ) from None
    got = [o.type for o in new.outputs]
    if got != expected:
        raise PassError(f"lower-spmd: {describe(node)} gives local types "
                        f"{', '.join(map(str, got))}, the plan expects "
                        f"{', '.join(map(str, expected))}")
    for out, old in zip(new.outputs, node.outputs):
        out.layout = old.layout
    return new.outputs


@register_pass("lower-spmd")
@dataclass
class LowerSPMD(Pass):
    """Replace each sharded graph by its SPMD device program (local shapes, collectives)."""

    def run(self, program: Program, ctx: PassContext) -> bool:
        lowered = {}
        for graph in program:
            if graph.attrs.get("spmd"):
                lowered[graph.name] = graph
                continue
            spmd = lower_graph(graph)
            ctx.options.setdefault("global_graphs", {})[spmd.name] = graph
            lowered[spmd.name] = spmd
        program.graphs = lowered
        return True
