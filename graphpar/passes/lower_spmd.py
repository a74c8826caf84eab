"""`lower-spmd`: a sharded global graph becomes the SPMD program every device of the mesh runs.

Shapes become local (each value's layout applied to its global shape), shape-carrying
attributes follow, and every `reshard` becomes the collectives (and free local steps) that the
cost model planned for it, so the communication the program performs is exactly what the ILP
priced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphpar.cost.communication import Step, resharding_cost
from graphpar.errors import PassError
from graphpar.ir.graph import Graph, Node, Program, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import StepKind, Trait, get_op
from graphpar.ir.spmd_ops import GROUP_OPS, LOCAL_OPS
from graphpar.ir.verify import describe
from graphpar.passes.manager import Pass, PassContext, register_pass


class GlobalGraphs(dict[str, Graph]):
    """lower-spmd's result: the global (sharded) graph of each device program, by its name."""


def graph_mesh(graph: Graph) -> Mesh:
    if graph.mesh is None:
        raise PassError(f"graph @{graph.name} has no mesh: run auto-shard before lower-spmd")
    return graph.mesh


def lower_graph(graph: Graph) -> Graph:
    """The SPMD program of a sharded graph (see the module docstring)."""
    mesh = graph_mesh(graph)
    local = Graph(f"{graph.name}_spmd", attrs={**graph.attrs, "spmd": True}, mesh=mesh)
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
    local_attrs = get_op(node.op).local_attrs
    if local_attrs is not None:
        attrs = local_attrs(attrs, [v.type if isinstance(v, Value) else None
                                    for v in node.inputs],
                            [v.type if isinstance(v, Value) else None for v in operands])
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
            ctx.result(GlobalGraphs)[spmd.name] = graph
            lowered[spmd.name] = spmd
        program.graphs = lowered
        return True


# The attributes each group or local op takes beyond axes and n, as the Step fields they copy.
_STEP_FIELDS = {
    "all_reduce": {"op": "reduce_op"},
    "all_gather": {"dim": "gather_dim"},
    "reduce_scatter": {"dim": "scatter_dim", "op": "reduce_op"},
    "all_to_all": {"split_dim": "scatter_dim", "concat_dim": "gather_dim"},
    "local_slice": {"dim": "scatter_dim"},
    "local_zero": {"op": "reduce_op"},
    "local_pad": {"dim": "gather_dim"},
}


def emit_step(graph: Graph, step: Step, value: Value, before: Node | None = None, *,
              module: str | None = None, loc: str | None = None) -> Value:
    """Append (or insert before `before`) the node for one cost-model `Step` applied to
    `value`, a device-local value, and return its result.

        ALL_REDUCE      all_reduce     {axes, n, op=reduce_op}
        ALL_GATHER      all_gather     {axes, n, dim=gather_dim}
        REDUCE_SCATTER  reduce_scatter {axes, n, dim=scatter_dim, op=reduce_op}
        ALL_TO_ALL      all_to_all     {axes, n, split_dim=scatter_dim, concat_dim=gather_dim}
        LOCAL_SLICE     local_slice    {axes, n, dim=scatter_dim}
        LOCAL_ZERO      local_zero     {axes, n, op=reduce_op}   (identity unless op is sum)
        LOCAL_PAD       local_pad      {axes, n, dim=gather_dim}

    `axes` are `step.axes` (ascending), `n` is `step.group_size`. Broadcast and send/recv
    steps have no single-node form here and raise ValueError. The op is the one whose
    declared `comm_kind` is the step's kind.
    """
    kind = StepKind(step.kind)
    op = next((name for name in GROUP_OPS + LOCAL_OPS if get_op(name).comm_kind == kind), None)
    if op is None:
        raise ValueError(f"emit_step: no SPMD op for a {kind} step ({step})")
    attrs: dict[str, Any] = {"axes": tuple(sorted(step.axes)), "n": int(step.group_size)}
    for attr, field in _STEP_FIELDS[op].items():
        v = getattr(step, field)
        if field == "reduce_op":
            v = v or "sum"
        elif v is None:
            raise ValueError(f"{kind} step needs {field}: {step}")
        attrs[attr] = v
    node = graph.create(op, [value], attrs, module=module, loc=loc, before=before)
    return node.output
