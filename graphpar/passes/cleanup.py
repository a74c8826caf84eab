"""Cleanup passes: dead-code elimination, CSE, canonicalization and constant folding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.registry import OpKind, Trait, get_op
from graphpar.ir.types import dtype_name
from graphpar.passes.manager import GraphPass, PassContext, register_alias, register_pass


@register_pass("dce")
@dataclass
class DeadCodeElimination(GraphPass):
    """Drop nodes none of whose results reach a graph output; an op that writes an operand in
    place (`writes-operand`) has an effect of its own and stays."""

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        live = {o.value for o in graph.outputs}
        dead = []
        for node in reversed(graph.nodes):
            if any(out in live for out in node.outputs) or _writes_operand(node):
                live.update(node.input_values)
            else:
                dead.append(node)
        graph.erase_all(dead)  # users before producers, so each erase sees no remaining use
        return bool(dead)


def _writes_operand(node: Node) -> bool:
    return get_op(node.op).has(Trait.WRITES_OPERAND)


def _key(node: Node):
    operands = tuple(("v", id(v)) if isinstance(v, Value) else ("s", type(v).__name__, v)
                     for v in node.inputs)
    return node.op, operands, tuple(sorted(node.attrs.items()))


@register_pass("cse")
@dataclass
class CommonSubexpressionElimination(GraphPass):
    """Replace a node by an earlier identical one (same op, operands and attributes). A node
    that writes an operand is never merged: each one is a write of its own."""

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        seen: dict[tuple, Node] = {}
        duplicates = []
        replaced: dict[Value, Value] = {}
        for node in graph.nodes:
            if _writes_operand(node):
                continue
            key = _key(node)
            first = seen.setdefault(key, node)
            if first is not node:
                for old, new in zip(node.outputs, first.outputs):
                    graph.replace_all_uses(old, new, outputs=False)
                    replaced[old] = new
                duplicates.append(node)
        graph.replace_outputs(replaced)  # once: linear however many nodes merge
        graph.erase_all(duplicates)
        return bool(duplicates)


def _producer(v, op: str) -> Node | None:
    return v.producer if isinstance(v, Value) and v.producer is not None and \
        v.producer.op == op else None


@register_pass("canonicalize")
@dataclass
class Canonicalize(GraphPass):
    """Local rewrites to one canonical form: fold chains of views and drop no-ops.

    reshape(reshape(x)) -> reshape(x); permute(permute(x)) -> one permute; a reshape, permute,
    expand, slice or convert that leaves its operand's type and data as they are -> the operand;
    clone(x) -> x; x*1, x+0, x-0, x/1 -> x when the type does not change.
    """

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        replaced: dict[Value, Value] = {}
        for node in list(graph.nodes):
            replacement = self._rewrite(graph, node)
            if replacement is not None:
                graph.replace_all_uses(node.output, replacement, outputs=False)
                replaced[node.output] = replacement
        graph.replace_outputs(replaced)
        changed = bool(replaced)
        if changed:
            DeadCodeElimination().run_on_graph(graph, ctx)
        return changed

    def _rewrite(self, graph: Graph, node: Node) -> Value | None:
        op, x = node.op, node.inputs[0] if node.inputs else None
        if op == "clone":
            return x
        if op in ("reshape", "expand", "convert") and x.type == node.output.type:
            return x
        if op == "permute" and node.attrs["dims"] == tuple(range(x.type.rank)):
            return x
        if op == "slice" and x.type == node.output.type:
            return x
        if op == "reshape" and (inner := _producer(x, "reshape")) is not None:
            node.replace_input(x, inner.inputs[0])
            return self._rewrite(graph, node)
        if op == "permute" and (inner := _producer(x, "permute")) is not None:
            outer_dims, inner_dims = node.attrs["dims"], inner.attrs["dims"]
            node.attrs["dims"] = tuple(inner_dims[d] for d in outer_dims)
            node.replace_input(x, inner.inputs[0])
            return self._rewrite(graph, node)
        if op in ("mul", "div", "add", "sub") and len(node.inputs) == 2:
            a, b = node.inputs
            identity = 1 if op in ("mul", "div") else 0
            if isinstance(a, Value) and not isinstance(b, Value) and b == identity and \
                    not isinstance(b, bool) and a.type == node.output.type:
                return a
            if op in ("mul", "add") and isinstance(b, Value) and not isinstance(a, Value) and \
                    a == identity and not isinstance(a, bool) and b.type == node.output.type:
                return b
        return None


@register_pass("fold-constants")
@dataclass
class FoldConstants(GraphPass):
    """Evaluate nodes whose operands are all constants, when the result is one repeated value
    (or a small shape op of a `full`): the node becomes a `full`."""

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        replaced: dict[Value, Value] = {}
        for node in list(graph.nodes):
            if len(node.outputs) != 1 or not node.input_values:
                continue
            if not all(_producer(v, "full") is not None for v in node.input_values):
                continue
            value = self._uniform_result(node)
            if value is None:
                continue
            out_type = node.output.type
            full = graph.create("full", [], {"shape": out_type.shape, "value": value,
                                             "dtype": dtype_name(out_type.dtype)},
                                module=node.module, loc=node.loc, before=node)
            graph.replace_all_uses(node.output, full.output, outputs=False)
            replaced[node.output] = full.output
        graph.replace_outputs(replaced)
        changed = bool(replaced)
        if changed:
            DeadCodeElimination().run_on_graph(graph, ctx)
        return changed

    @staticmethod
    def _uniform_result(node: Node):
        """The single value every element of the result has, or None."""
        op = get_op(node.op)
        if op.kind is OpKind.SHAPE:  # moving a uniform tensor around keeps it uniform
            values = {v.producer.attrs["value"] for v in node.input_values}
            if not op.has(Trait.KEEPS_UNIFORM) or len(values) != 1:
                return None
            return values.pop()
        if op.kind is not OpKind.ELEMENTWISE:
            return None
        args = []
        for v in node.inputs:
            if isinstance(v, Value):
                # Evaluate on one element: a uniform input gives a uniform elementwise result.
                args.append(torch.full((), v.producer.attrs["value"], dtype=v.type.dtype))
            else:
                args.append(v)
        result = op.reference(*args, **node.attrs)
        if result.dtype != node.output.type.dtype:
            return None
        value = result.item()
        return bool(value) if result.dtype == torch.bool else value


register_alias("cleanup", "canonicalize,fold-constants,cse,dce")
