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

A sharded graph names the mesh it runs on, declared before it together with the cluster the
mesh was costed on (as Shardy declares `sdy.mesh @mesh = <["x"=2, "y"=4]>`):

    cluster @dgx-a100 = {name="dgx-a100", num_nodes=1, devices_per_node=8, ...}
    mesh @mesh = <["dp"=2, "tp"=4]> on @dgx-a100 {bandwidth=[...], latency=[...]}
    graph @gpt(...) on @mesh {

`annotate(node)` may add text after `#` (the dumps pass the cost model's estimate of each
collective's bytes and time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import Graph, Node, OutputRole, Value, install_printer
from graphpar.ir.mesh import Mesh
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


def node_numbers(graph: Graph) -> dict[Node, int]:
    """The number the printer gives each node's first result (`%12`): node results are
    numbered in graph order, graph inputs keep their names."""
    numbers, counter = {}, 0
    for node in graph.nodes:
        numbers[node] = counter
        counter += len(node.outputs)
    return numbers


class _Names:
    def __init__(self, graph: Graph):
        self.names: dict[Value, str] = {v: v.name for v in graph.inputs}
        for node, first in node_numbers(graph).items():
            for k, out in enumerate(node.outputs):
                self.names[out] = str(first + k)

    def __call__(self, operand: Any) -> str:
        if isinstance(operand, Value):
            return "%" + self.names[operand]
        return format_attr(operand)


def _typed(value: Value) -> str:
    text = str(value.type)
    if value.layout is not None:
        text += f" {value.layout}"
    return text


# Cluster fields printed in a declaration: everything but the documentation string.
CLUSTER_FIELDS = tuple(f.name for f in dataclasses.fields(Cluster) if f.name != "source")
# fields left out of a declaration when they hold these (their defaults): empty tables, no
# per-byte price
_UNSET = {f.name: f.default for f in dataclasses.fields(Cluster)
          if f.default in ((), 0.0) and not isinstance(f.default, bool)}


class _Declarations:
    """Names for the clusters and meshes that a set of graphs runs on, in order of use."""

    def __init__(self, graphs: Iterable[Graph]):
        meshes = list(dict.fromkeys(g.mesh for g in graphs if g.mesh is not None))
        clusters = list(dict.fromkeys(m.cluster for m in meshes if m.cluster is not None))
        self.cluster_names: dict[Cluster, str] = {}
        for c in clusters:
            base = re.sub(r"[^A-Za-z0-9_.\-]", "_", c.name) or "cluster"
            name, k = base, 1
            while name in self.cluster_names.values():
                name, k = f"{base}.{k}", k + 1
            self.cluster_names[c] = name
        single = len(meshes) == 1
        self.mesh_names = {m: "mesh" if single else f"mesh{i}" for i, m in enumerate(meshes)}

    def lines(self) -> list[str]:
        out = []
        for c, name in self.cluster_names.items():
            # Empty tables are left out: the cluster then prices by its peak rates and links.
            fields = {f: getattr(c, f) for f in CLUSTER_FIELDS
                      if f not in _UNSET or getattr(c, f) != _UNSET[f]}
            out.append(f"cluster @{name} ={format_attrs(fields)}")
        for m, name in self.mesh_names.items():
            out.append(f"mesh @{name} = {format_mesh_axes(m)}"
                       + (f" on @{self.cluster_names[m.cluster]}" if m.cluster else "")
                       + format_attrs(_mesh_attrs(m)))
        return out


def format_mesh_axes(mesh: Mesh) -> str:
    """<["dp"=2, "tp"=4]> with axis names, <[2, 4]> without."""
    if mesh.axis_names is None:
        return "<[" + ", ".join(map(str, mesh.shape)) + "]>"
    return "<[" + ", ".join(f"{json.dumps(a)}={n}" for a, n in
                            zip(mesh.axis_names, mesh.shape)) + "]>"


def _mesh_attrs(mesh: Mesh) -> dict[str, Any]:
    attrs: dict[str, Any] = {"bandwidth": mesh.bandwidth, "latency": mesh.latency}
    if mesh.device_ids != tuple(range(mesh.size)):
        attrs["devices"] = mesh.device_ids
    return attrs


def print_graph(graph: Graph, show_source: bool = False, show_cost: bool = True,
                annotate: Callable[[Node], str] | None = None) -> str:
    """One graph with the declarations of the mesh it runs on."""
    return print_program([graph], show_source, show_cost, annotate)


def print_program(graphs: Iterable[Graph], show_source: bool = False, show_cost: bool = True,
                  annotate: Callable[[Node], str] | None = None) -> str:
    """Graphs after the declarations of their clusters and meshes, each declared once."""
    graphs = list(graphs)
    decls = _Declarations(graphs)
    head = decls.lines()
    texts = [_print_graph(g, decls, show_source, show_cost, annotate) for g in graphs]
    return ("\n".join(head) + "\n" if head else "") + "\n".join(texts)


def _print_graph(graph: Graph, decls: _Declarations, show_source: bool, show_cost: bool,
                 annotate: Callable[[Node], str] | None) -> str:
    name = _Names(graph)
    lines = [f"graph @{graph.name}("]
    for v in graph.inputs:
        lines.append(f"    %{v.name}: {_typed(v)} {v.role.value},")
    on_mesh = f" on @{decls.mesh_names[graph.mesh]}" if graph.mesh is not None else ""
    header_attrs = f" attrs{format_attrs(graph.attrs)}" if graph.attrs else ""
    lines.append(f"){on_mesh}{header_attrs} {{")
    for node in graph.nodes:
        results = ", ".join(name(o) for o in node.outputs)
        left = f"  {results} = {node.op}({', '.join(name(v) for v in node.inputs)})"
        left += format_attrs(node.attrs)
        right = ": " + ", ".join(_typed(o) for o in node.outputs)
        if show_source and (node.loc or node.module):
            right += f"  loc({format_attr(node.loc)}, {format_attr(node.module)})"
        if show_cost:
            notes = []
            flops = node_flops(node)
            if flops:
                notes.append(format_count(flops, "FLOP"))
            if annotate is not None and (note := annotate(node)):
                notes.append(note)
            if notes:
                right += "    # " + ", ".join(notes)
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


install_printer(print_program)
