"""The IR's text form: a stable, readable listing that `graphpar.ir.parser` reads back.

    graph @mlp(
        %x: f32[4,16] input,
        %fc1.weight: f32[32,16] param,
    ) {
      %0 = linear(%x, %fc1.weight, none)     : f32[4,32]    # 4.1 KFLOP
      %1 = relu(%0)                          : f32[4,32]    # 128 FLOP
      return %1 output
    }

Intermediate values are numbered in order of definition; graph inputs keep their names.
Costs after `#` are derived and ignored by the parser; `loc(...)` (printed with
`show_source=True`) carries the source line and module path back in.
"""

from __future__ import annotations

import json
import math
from typing import Any

from graphpar.ir.graph import Graph, OutputRole, Value
from graphpar.ir.ops import get_op

TYPE_COLUMN = 56  # where types start when the left part is short enough: listings align


def format_attr(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    raise TypeError(f"attribute value {value!r} is not plain data")


def format_attrs(attrs: dict[str, Any]) -> str:
    if not attrs:
        return ""
    return " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in attrs.items()) + "}"


def format_count(n: float, unit: str) -> str:
    """1234567 -> '1.2 MFLOP': the decimal prefixes a reader expects for counts."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{int(n)} {unit}"


class _Names:
    def __init__(self, graph: Graph):
        self.names: dict[Value, str] = {v: v.name for v in graph.inputs}
        counter = 0
        for node in graph.nodes:
            for out in node.outputs:
                self.names[out] = str(counter)
                counter += 1

    def __call__(self, operand: Any) -> str:
        if isinstance(operand, Value):
            return "%" + self.names[operand]
        return format_attr(operand)


def _typed(value: Value) -> str:
    text = str(value.type)
    if value.layout is not None:
        text += f" {value.layout}"
    return text


def print_graph(graph: Graph, show_source: bool = False, show_cost: bool = True) -> str:
    name = _Names(graph)
    lines = [f"graph @{graph.name}("]
    for v in graph.inputs:
        lines.append(f"    %{v.name}: {_typed(v)} {v.role.value},")
    header_attrs = f" attrs{format_attrs(graph.attrs)}" if graph.attrs else ""
    lines.append(f"){header_attrs} {{")
    for node in graph.nodes:
        results = ", ".join(name(o) for o in node.outputs)
        left = f"  {results} = {node.op}({', '.join(name(v) for v in node.inputs)})"
        left += format_attrs(node.attrs)
        right = ": " + ", ".join(_typed(o) for o in node.outputs)
        if show_source and (node.loc or node.module):
            right += f"  loc({format_attr(node.loc)}, {format_attr(node.module)})"
        if show_cost:
            flops = node_flops(node)
            if flops:
                right += f"    # {format_count(flops, 'FLOP')}"
        lines.append(f"{left.ljust(TYPE_COLUMN - 1)} {right}")
    outs = []
    for out in graph.outputs:
        tag = out.role.value
        if out.role in (OutputRole.GRAD, OutputRole.UPDATE):
            tag += f"(%{out.target})"
        outs.append(f"{name(out.value)} {tag}")
    lines.append("  return " + ",\n         ".join(outs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def node_flops(node) -> int:
    operands = [getattr(v, "type", v) for v in node.inputs]
    return get_op(node.op).flops(operands, [o.type for o in node.outputs], node.attrs)
