"""The verifier: SSA, order, types, layouts and mesh axes of a graph; the failing node is named."""

from __future__ import annotations

import math
from collections.abc import Callable

from graphpar.errors import GraphparError, ShardingError, VerificationError
from graphpar.ir.graph import PERSISTENT_ROLES, Graph, Node, OutputRole, Role, Value
from graphpar.ir.ops import get_op
from graphpar.ir.spmd_ops import GROUP_OPS, LOCAL_OPS, SPMD_OPS

_PROGRESS_NODES = 1 << 16


def describe(node: Node, graph: Graph | None = None, index: int | None = None) -> str:
    """`node 12 (matmul) at gpt.py:42 in blocks.0.attn`: how errors point at a node. Pass the
    node's `index` when it is known: finding it is a scan of the graph."""
    if index is None:
        graph = graph or node.graph
        index = graph.nodes.index(node) if graph is not None and node in graph.nodes else "?"
    text = f"node {index} ({node.op})"
    if node.loc:
        text += f" at {node.loc}"
    if node.module:
        text += f" in {node.module}"
    return text


def check_structure(graph: Graph) -> None:
    """Layouts against their value's rank and the graph's mesh, and the mesh axes of
    collectives: what can be checked without type inference (the parser always does).

    A graph declared on no mesh runs whole on one device: its layouts must be fully
    replicated and it has no SPMD op (collective, local step, send or receive)."""
    local = bool(graph.attrs.get("spmd"))  # per-device shapes: sharded dims are already split
    for v in graph.inputs:
        problem = v.layout is not None and _layout_problem(v, graph, local)
        if problem:
            raise VerificationError(f"graph @{graph.name}: input %{v.name}: {problem}", v)
    for index, node in enumerate(graph):
        for i, out in enumerate(node.outputs):
            problem = out.layout is not None and _layout_problem(out, graph, local)
            if problem:
                raise VerificationError(f"graph @{graph.name}, {describe(node, graph, index)}: "
                                        f"result {i}: {problem}", node)
        if node.op in SPMD_OPS:
            problem = _spmd_problem(node, graph)
            if problem:
                raise VerificationError(f"graph @{graph.name}, {describe(node, graph, index)}: "
                                        f"{problem}", node)


def _no_mesh(graph: Graph) -> str:
    return (f"graph @{graph.name} is declared on no mesh; declare the mesh it runs on "
            f"(`mesh @mesh = <[2, 2]>` and `graph @{graph.name}(...) on @mesh`)")


def _layout_problem(value: Value, graph: Graph, local: bool) -> str | None:
    layout, type_, mesh = value.layout, value.type, graph.mesh  # declared: graph @g(...) on @mesh
    if mesh is None:
        if not layout.is_replicated:
            return (f"layout {layout} is not fully replicated but {_no_mesh(graph)}, or make "
                    "the layout replicated ({R})")
    elif layout.mesh_ndim != mesh.ndim:
        return (f"layout {layout} has {layout.mesh_ndim} placement(s) but the graph's mesh "
                f"{mesh} has {mesh.ndim} axes; give one placement per mesh axis")
    too_high = [d for d in layout.sharded_dims if d >= type_.rank]
    if too_high:
        return f"layout {layout} shards dim {too_high[0]}, but {type_} has {type_.rank} dim(s)"
    if mesh is not None and not local:
        try:
            layout.check(type_.shape, mesh)
        except ShardingError as exc:
            return str(exc)
    return None


def _spmd_problem(node: Node, graph: Graph) -> str | None:
    """An SPMD op on a graph with no mesh, or a collective along axes its mesh lacks."""
    mesh = graph.mesh
    if mesh is None:
        return f"{node.op} runs across the devices of a mesh but {_no_mesh(graph)}"
    if node.op not in GROUP_OPS and node.op not in LOCAL_OPS:
        return None  # send / recv name global ranks, not mesh axes
    axes = node.attrs.get("axes")
    axes = (axes,) if isinstance(axes, int) and not isinstance(axes, bool) else axes
    if not isinstance(axes, (tuple, list)):
        return None  # the op's type rule names a malformed attribute
    bad = [a for a in axes if not isinstance(a, int) or isinstance(a, bool)
           or not 0 <= a < mesh.ndim]
    if bad:
        return (f"mesh axis {bad[0]} does not exist: the graph's mesh {mesh} has axes "
                f"0..{mesh.ndim - 1}; name axes of that mesh (or declare the graph on a "
                "mesh that has them)")
    return None


def verify(graph: Graph, check_types: bool = True,
           on_progress: Callable[[int, int], None] | None = None) -> None:
    """Raise VerificationError at the first broken invariant. Linear in the graph's size;
    `on_progress(nodes_done, nodes_total)` is called every 65536 nodes."""
    defined: set[Value] = set()
    names = set()
    for v in graph.inputs:
        if v.producer is not None or v.name is None:
            raise VerificationError(f"graph @{graph.name}: input {v!r} is not a named input", v)
        if v.name in names:
            raise VerificationError(f"graph @{graph.name}: input %{v.name} is defined twice", v)
        names.add(v.name)
        defined.add(v)
    check_structure(graph)
    _check_graph_attrs(graph)
    total = len(graph)
    for index, node in enumerate(graph):
        if on_progress is not None and index and index % _PROGRESS_NODES == 0:
            on_progress(index, total)
        problem = _check_node(node, graph, defined, check_types)
        if problem:
            raise VerificationError(f"graph @{graph.name}, {describe(node, graph, index)}: "
                                    f"{problem}", node)
        defined.update(node.outputs)
    for v in defined:
        for user in v.users:
            if user.graph is not graph:
                raise VerificationError(f"graph @{graph.name}: {v!r} lists a user not in it", v)
    _check_outputs(graph, defined)


# Graph attributes that passes write and readers (the pipeline view, reports) read back from
# a file: what each must be. Other attributes are free-form.
_GRAPH_ATTRS = {
    "token_slices": ("a list of token counts >= 1", "counts"),
    "batch_slices": ("a list of sequence counts >= 1", "counts"),
    "est_seconds": ("a number of seconds >= 0", "amount"),
    "mem_bytes": ("a number of bytes >= 0", "amount"),
}


def _check_graph_attrs(graph: Graph) -> None:
    for key, (want, kind) in _GRAPH_ATTRS.items():
        if key not in graph.attrs:
            continue
        value = graph.attrs[key]
        if kind == "counts":
            ok = isinstance(value, (tuple, list)) and bool(value) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
        else:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) and value >= 0)
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise VerificationError(f"graph @{graph.name}: attribute {key}={shown}: expected "
                                    f"{want}", graph)


def _check_node(node: Node, graph: Graph, defined: set[Value], check_types: bool) -> str | None:
    """What is wrong with one node, or None."""
    if node.graph is not graph:
        return "the node does not belong to this graph"
    try:
        opdef = get_op(node.op)
    except GraphparError as exc:
        return str(exc)
    if opdef.num_outputs is not None and len(node.outputs) != opdef.num_outputs:
        return f"has {len(node.outputs)} results, the op has {opdef.num_outputs}"
    for i, v in enumerate(node.inputs):
        if isinstance(v, Value):
            if v not in defined:
                return (f"operand {i} is used before it is defined (or comes from another "
                        "graph); nodes must be in topological order")
            if node not in v.users:
                return f"operand {i} does not list it as a user"
    for out in node.outputs:
        if out.producer is not node:
            return "a result names another producer"
    return _type_problem(node, opdef) if check_types else None


def _type_problem(node: Node, opdef) -> str | None:
    operands = [getattr(v, "type", v) for v in node.inputs]
    try:
        expected = opdef.infer(operands, node.attrs)  # cached per (op, types, attributes)
    except TypeError as exc:
        return f"its operands do not fit the op: {exc}"
    actual = [o.type for o in node.outputs]
    if expected != actual:
        return (f"result types {', '.join(map(str, actual))} but the op gives "
                f"{', '.join(map(str, expected))}")
    return None


def _check_outputs(graph: Graph, defined: set[Value]) -> None:
    if not graph.outputs:
        raise VerificationError(f"graph @{graph.name} returns nothing; a model's forward must "
                                "return a tensor or a tuple of tensors", graph)
    updatable = {v.name: v for v in graph.inputs if v.role in PERSISTENT_ROLES}
    differentiable = {v.name: v for v in graph.inputs
                      if v.role is Role.INPUT and v.type.dtype.is_floating_point}
    for out in graph.outputs:
        if out.value not in defined:
            raise VerificationError(f"graph @{graph.name}: output {out.value!r} is not defined",
                                    graph)
        if out.role in (OutputRole.GRAD, OutputRole.UPDATE):
            target = updatable.get(out.target)
            if target is None and out.role is OutputRole.GRAD:
                # a gradient into a user input: token slicing's keys and values of earlier slices
                target = differentiable.get(out.target)
            if target is None:
                raise VerificationError(
                    f"graph @{graph.name}: output {out.role.value}(%{out.target}) names no "
                    "param, buffer or optimizer-state input"
                    + (" (or, for a gradient, a floating-point user input)"
                       if out.role is OutputRole.GRAD else ""), graph)
            if target.type.shape != out.value.type.shape:
                raise VerificationError(
                    f"graph @{graph.name}: output {out.role.value}(%{out.target}) has type "
                    f"{out.value.type}, the input has {target.type}", graph)
