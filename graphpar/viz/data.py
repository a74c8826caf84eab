"""The data a viz page draws: IR graphs as plain JSON (nodes, inputs, module groups, totals).

One dict per graph, built only from the IR, so a page can be regenerated from any `.gpir` file:

- `nodes`: op, kind (OpKind), outputs (value name, type, layout, bytes), operands (a producer
  node, a graph input or a literal), attributes as printed in the IR text, module, source line,
  FLOPs, phase (forward / backward / optimizer, in training graphs), the group that holds it and
  `info`, rows a caller adds (`node_info`, e.g. a cost model's time estimate);
- `inputs`: name, role, type, layout, bytes and the group it is drawn in (its first user's);
- `groups`: the module tree the page draws as collapsible clusters (see `module_groups`);
- `outputs`, `attrs` (e.g. `stage`, `device`) and a `summary` of counts, bytes and FLOPs.

Later passes show up by filling the IR, not this file: `value.layout` is printed with `str()`,
OpKind.COLLECTIVE ops are counted and flagged, and graph attributes are listed on each panel.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphpar.errors import GraphparError
from graphpar.ir.graph import Graph, Node, OutputRole, Program, Role, Value
from graphpar.ir.printer import format_attr, node_flops
from graphpar.ir.registry import OpKind, get_op
from graphpar.viz.stages import pipeline_data

SCHEMA_VERSION = 1
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
OPTIMIZER_MODULE = "optimizer"  # the module path graphpar.capture.optim gives its nodes

# Extra rows for a node's details, e.g. a cost model's estimate: {"time (est.)": "0.21 ms"}.
NodeInfo = Callable[[Node], Mapping[str, Any]]


def as_program(program_or_graph: Program | Graph) -> Program:
    if isinstance(program_or_graph, Program):
        return program_or_graph
    if isinstance(program_or_graph, Graph):
        return Program.of([program_or_graph])
    raise TypeError(f"expected a graphpar Graph or Program, got {type(program_or_graph).__name__}")


def program_data(program_or_graph: Program | Graph, node_info: NodeInfo | None = None,
                 stage_of: Mapping[Node, int] | None = None,
                 stage_estimates: Sequence[Mapping[str, float]] | None = None
                 ) -> dict[str, Any]:
    """The whole page's data: every graph, and totals over all of them; `pipeline` (see
    `graphpar.viz.stages`) when the program is an MPMD pipeline, and each node's `stage` where
    `stage_of` (a stage plan's node -> stage, for a sliced global graph) names it."""
    program = as_program(program_or_graph)
    graphs = [graph_data(g, node_info, stage_of) for g in program]
    totals: dict[str, Any] = {"graphs": len(graphs)}
    for key in ("nodes", "flops", "parameters", "parameter_bytes", "parameter_tensors",
                "collectives", "collective_bytes"):
        totals[key] = sum(g["summary"][key] for g in graphs)
    kinds: Counter[str] = Counter()
    for g in graphs:
        kinds.update(g["summary"]["kinds"])
    totals["kinds"] = dict(kinds)
    data = {"version": SCHEMA_VERSION, "graphs": graphs, "totals": totals}
    pipeline = pipeline_data(list(program), [g["summary"] for g in graphs],
                             stage_estimates)
    if pipeline is not None:
        data["pipeline"] = pipeline
    return data


def graph_data(graph: Graph, node_info: NodeInfo | None = None,
               stage_of: Mapping[Node, int] | None = None) -> dict[str, Any]:
    names = _value_names(graph)
    input_index = {v: i for i, v in enumerate(graph.inputs)}
    node_index = {n: i for i, n in enumerate(graph.nodes)}
    phases = node_phases(graph)
    groups, node_group = module_groups(graph, phases)

    def operand(v: Any) -> dict[str, Any]:
        if not isinstance(v, Value):
            return {"literal": format_attr(v)}
        ref: dict[str, Any] = {"value": names[v], "type": str(v.type)}
        if v.producer is None:
            ref["input"] = input_index[v]
        else:
            ref["node"] = node_index[v.producer]
            if len(v.producer.outputs) > 1:
                ref["output"] = v.index
        return ref

    nodes = []
    for i, node in enumerate(graph.nodes):
        entry: dict[str, Any] = {
            "id": i,
            "op": node.op,
            "kind": _kind(node),
            "outputs": [_value_entry(o, names[o]) for o in node.outputs],
            "inputs": [operand(v) for v in node.inputs],
            "flops": safe_flops(node),
        }
        if node.attrs:
            entry["attrs"] = {k: format_attr(v) for k, v in node.attrs.items()}
        for key, value in (("module", node.module), ("loc", node.loc),
                           ("phase", phases.get(node)), ("group", node_group.get(node)),
                           ("stage", stage_of.get(node) if stage_of else None)):
            if value is not None:
                entry[key] = value
        info = node_info(node) if node_info is not None else None
        if info:
            entry["info"] = {str(k): str(v) for k, v in info.items()}
        nodes.append(entry)

    inputs = []
    for v in graph.inputs:
        entry = _value_entry(v, v.name)
        entry["role"] = v.role.value if v.role is not None else Role.INPUT.value
        entry["numel"] = v.type.numel
        users = [node_index[u] for u in v.users if u in node_index]
        first = min(users, default=None)
        if first is not None and graph.nodes[first] in node_group:
            entry["group"] = node_group[graph.nodes[first]]
        inputs.append(entry)

    outputs = []
    for out in graph.outputs:
        entry = operand(out.value)
        entry["role"] = out.role.value
        if out.target is not None:
            entry["target"] = out.target
        outputs.append(entry)

    return {
        "name": graph.name,
        "attrs": {k: format_attr(v) for k, v in graph.attrs.items()},
        "inputs": inputs,
        "nodes": nodes,
        "outputs": outputs,
        "groups": groups,
        "summary": _summary(graph, nodes, inputs),
    }


def node_phases(graph: Graph) -> dict[Node, str]:
    """Forward, backward or optimizer, for training graphs (those with a loss output); else {}.

    Forward is everything the loss and the plain outputs depend on; optimizer nodes carry the
    module path "optimizer"; the rest is the backward pass.
    """
    if not any(o.role is OutputRole.LOSS for o in graph.outputs):
        return {}
    forward = _ancestors(o.value for o in graph.outputs
                         if o.role in (OutputRole.LOSS, OutputRole.OUTPUT))
    phases = {}
    for node in graph.nodes:
        if node in forward:
            phases[node] = FORWARD
        elif _first_component(node.module) == OPTIMIZER_MODULE:
            phases[node] = OPTIMIZER
        else:
            phases[node] = BACKWARD
    return phases


def module_groups(graph: Graph, phases: dict[Node, str]) -> tuple[list[dict], dict[Node, int]]:
    """The clusters a page draws, from module paths: a list of groups and each node's group.

    A group is a module path with at least two nodes under it. Module lists (`blocks`, whose
    children are `blocks.0`, `blocks.1`, ...) and paths with one child and no nodes of their own
    are not groups themselves, so a GPT's top level reads `tok_emb, blocks.0, ..., lm_head`.
    Training graphs get one group per phase at the top; optimizer nodes are grouped by the
    parameter they update. Nodes without a module path sit directly in their phase (or at the top).
    """
    optimizer_paths = _optimizer_paths(graph, phases)
    root = _Trie(())
    for i, node in enumerate(graph.nodes):
        phase = phases.get(node)
        if phase == OPTIMIZER:
            path = optimizer_paths.get(node, ())
        else:
            path = tuple(node.module.split(".")) if node.module else ()
        trie = root.child(phase, (), i) if phase else root
        for depth in range(len(path)):
            trie = trie.child(path[depth], path[:depth + 1], i)
        trie.nodes.append(node)

    groups: list[dict[str, Any]] = []
    node_group: dict[Node, int] = {}

    def emit(t: _Trie, parent: int | None, phase: str | None, forced: bool = False) -> None:
        children = sorted(t.children.values(), key=lambda c: c.first)
        if not forced:
            if t.total <= 1:
                for node in t.all_nodes():
                    if parent is not None:
                        node_group[node] = parent
                return
            if not t.nodes and (len(children) == 1 or all(c.name.isdigit() for c in children)):
                for c in children:
                    emit(c, parent, phase)
                return
        gid = len(groups)
        group: dict[str, Any] = {"id": gid, "label": phase if forced else ".".join(t.path)}
        if t.path:
            group["module"] = ".".join(t.path)
        if parent is not None:
            group["parent"] = parent
        if phase:
            group["phase"] = phase
        groups.append(group)
        for node in t.nodes:
            node_group[node] = gid
        for c in children:
            emit(c, gid, phase)

    for t in sorted(root.children.values(), key=lambda c: c.first):
        if t.path == () and t.name in (FORWARD, BACKWARD, OPTIMIZER):
            emit(t, None, t.name, forced=True)
        else:
            emit(t, None, None)
    return groups, node_group


class _Trie:
    __slots__ = ("name", "path", "children", "nodes", "first", "total")

    def __init__(self, path: tuple[str, ...], name: str = ""):
        self.name = name
        self.path = path
        self.children: dict[str, _Trie] = {}
        self.nodes: list[Node] = []
        self.first = -1  # index of the first node under it: groups are ordered like the program
        self.total = 0

    def child(self, name: str, path: tuple[str, ...], index: int) -> _Trie:
        c = self.children.get(name)
        if c is None:
            c = self.children[name] = _Trie(path, name)
            c.first = index
        c.total += 1
        return c

    def all_nodes(self) -> list[Node]:
        out = list(self.nodes)
        for c in self.children.values():
            out.extend(c.all_nodes())
        return out


def _optimizer_paths(graph: Graph, phases: dict[Node, str]) -> dict[Node, tuple[str, ...]]:
    """For optimizer nodes that update exactly one parameter: that parameter's module path."""
    params = sorted((v.name for v in graph.inputs if v.role is Role.PARAM),
                    key=len, reverse=True)
    owners: dict[Node, set[str]] = {}
    for out in graph.outputs:
        if out.role is not OutputRole.UPDATE or out.target is None:
            continue
        # An update's target is a parameter or a state slot named after one ("w.exp_avg").
        param = next((p for p in params if out.target == p or out.target.startswith(p + ".")),
                     None)
        if param is None:
            continue
        stack = [out.value.producer]
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or phases.get(node) != OPTIMIZER:
                continue
            seen.add(node)
            owners.setdefault(node, set()).add(param)
            stack.extend(v.producer for v in node.input_values)
    paths = {}
    for node, owned in owners.items():
        if len(owned) == 1:
            module = next(iter(owned)).rpartition(".")[0]
            paths[node] = tuple(module.split(".")) if module else ()
    return paths


def _ancestors(values) -> set[Node]:
    seen: set[Node] = set()
    stack = [v.producer for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(v.producer for v in node.input_values)
    return seen


def _first_component(module: str | None) -> str | None:
    return module.split(".")[0] if module else None


def _value_names(graph: Graph) -> dict[Value, str]:
    """`%x` for inputs, `%0`, `%1`, ... for node results: the numbering of the IR printer."""
    names = {v: f"%{v.name}" for v in graph.inputs}
    counter = 0
    for node in graph.nodes:
        for out in node.outputs:
            names[out] = f"%{counter}"
            counter += 1
    return names


def _value_entry(value: Value, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "type": str(value.type), "bytes": value.type.nbytes}
    if value.layout is not None:
        entry["layout"] = str(value.layout)
    return entry


def _kind(node: Node) -> str:
    try:
        return get_op(node.op).kind.value
    except GraphparError:
        return "unknown"


def safe_flops(node: Node) -> int:
    """The IR's FLOP estimate of a node, 0 for an op without a cost rule for its operands."""
    try:
        return node_flops(node)
    except (GraphparError, TypeError, ValueError, IndexError, AttributeError):
        return 0  # an op without a cost rule for these operands: shown as no FLOPs, not an error


def _summary(graph: Graph, nodes: list[dict], inputs: list[dict]) -> dict[str, Any]:
    roles: dict[str, dict[str, int]] = {}
    for entry in inputs:
        r = roles.setdefault(entry["role"], {"count": 0, "numel": 0, "bytes": 0})
        r["count"] += 1
        r["numel"] += entry["numel"]
        r["bytes"] += entry["bytes"]
    params = roles.get(Role.PARAM.value, {"count": 0, "numel": 0, "bytes": 0})
    collectives = [n for n in nodes if n["kind"] == OpKind.COLLECTIVE.value]
    kind_flops: Counter[str] = Counter()
    for n in nodes:
        kind_flops[n["kind"]] += n["flops"]
    layouts = Counter(o["layout"] for n in nodes for o in n["outputs"] if "layout" in o)
    layouts.update(entry["layout"] for entry in inputs if "layout" in entry)
    return {
        "nodes": len(nodes),
        "flops": sum(n["flops"] for n in nodes),
        "kinds": dict(Counter(n["kind"] for n in nodes).most_common()),
        "kind_flops": dict(kind_flops),
        "ops": dict(Counter(n["op"] for n in nodes).most_common()),
        "phases": dict(Counter(n["phase"] for n in nodes if "phase" in n)),
        "stages": {str(k): v for k, v in sorted(Counter(
            n["stage"] for n in nodes if "stage" in n).items())},
        "roles": roles,
        "parameters": params["numel"],
        "parameter_bytes": params["bytes"],
        "parameter_tensors": params["count"],
        "collectives": len(collectives),
        "collective_bytes": sum(o["bytes"] for n in collectives for o in n["outputs"]),
        "layouts": dict(layouts.most_common()),
        "outputs": dict(Counter(o.role.value for o in graph.outputs)),
    }
