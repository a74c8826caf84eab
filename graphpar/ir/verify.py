"""The verifier: SSA, order, types and outputs of a graph checked; the failing node is named."""

from __future__ import annotations

from graphpar.errors import GraphparError, VerificationError
from graphpar.ir.graph import Graph, Node, OutputRole, Role, Value
from graphpar.ir.ops import get_op


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


def verify(graph: Graph, check_types: bool = True) -> None:
    """Raise VerificationError at the first broken invariant."""
    defined: set[Value] = set()
    names = set()
    for v in graph.inputs:
        if v.producer is not None or v.name is None:
            raise VerificationError(f"graph @{graph.name}: input {v!r} is not a named input")
        if v.name in names:
            raise VerificationError(f"graph @{graph.name}: input %{v.name} is defined twice")
        names.add(v.name)
        defined.add(v)
    for index, node in enumerate(graph.nodes):
        where = f"graph @{graph.name}, {describe(node, graph, index)}"
        if node.graph is not graph:
            raise VerificationError(f"{where}: the node does not belong to this graph")
        try:
            opdef = get_op(node.op)
        except GraphparError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        if opdef.num_outputs is not None and len(node.outputs) != opdef.num_outputs:
            raise VerificationError(
                f"{where}: has {len(node.outputs)} results, the op has {opdef.num_outputs}")
        for i, v in enumerate(node.inputs):
            if isinstance(v, Value):
                if v not in defined:
                    raise VerificationError(
                        f"{where}: operand {i} is used before it is defined (or comes from "
                        "another graph); nodes must be in topological order")
                if node not in v.users:
                    raise VerificationError(f"{where}: operand {i} does not list it as a user")
        if check_types:
            _check_types(node, opdef, where)
        for out in node.outputs:
            if out.producer is not node:
                raise VerificationError(f"{where}: a result names another producer")
            defined.add(out)
    for v in defined:
        for user in v.users:
            if user.graph is not graph:
                raise VerificationError(f"graph @{graph.name}: {v!r} lists a user not in it")
    updatable = {v.name: v for v in graph.inputs
                 if v.role in (Role.PARAM, Role.BUFFER, Role.OPTIM_STATE)}
    for out in graph.outputs:
        if out.value not in defined:
            raise VerificationError(f"graph @{graph.name}: output {out.value!r} is not defined")
        if out.role in (OutputRole.GRAD, OutputRole.UPDATE):
            target = updatable.get(out.target)
            if target is None:
                raise VerificationError(
                    f"graph @{graph.name}: output {out.role.value}(%{out.target}) names no "
                    "param, buffer or optimizer-state input")
            if target.type.shape != out.value.type.shape:
                raise VerificationError(
                    f"graph @{graph.name}: output {out.role.value}(%{out.target}) has type "
                    f"{out.value.type}, the input has {target.type}")


def _check_types(node: Node, opdef, where: str) -> None:
    try:
        expected = opdef.infer([getattr(v, "type", v) for v in node.inputs], node.attrs)
    except TypeError as exc:
        raise VerificationError(f"{where}: its operands do not fit the op: {exc}") from None
    actual = [o.type for o in node.outputs]
    if expected != actual:
        shown = ", ".join(map(str, expected))
        raise VerificationError(
            f"{where}: result types {', '.join(map(str, actual))} but the op gives {shown}")
