"""A training graph cut into pipeline stages: forward / backward / optimizer parts, stage
assignment of every node from an assignment of the forward ones, and stage subgraphs.

A captured training step is one joint graph. Its nodes fall in three parts:

- forward: what the loss depends on (and the batch-norm statistics the forward updates);
- optimizer: the update nodes that graphpar's optimizer appended (`graphpar.capture.optim`),
  and everything computed from them;
- backward: the rest, which computes the gradients.

Stage slicing decides the stage of forward nodes only (layers are forward ops). `follow_forward`
puts each backward op on the stage of the forward op it differentiates, and each optimizer
update on the stage of its parameter, so that a layer's forward, backward and update share a
stage, as Alpa's stage construction does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphpar.errors import PassError
from graphpar.ir.graph import Graph, Node, Output, OutputRole, Role, Value, copy_nodes
from graphpar.ir.printer import node_flops

__all__ = ["equal_flops_stages", "follow_forward", "forward_backward_optimizer",
           "parameter_stages", "stage_subgraph", "value_name"]

def _ancestors(values: Iterable[Value]) -> set[Node]:
    seen: set[Node] = set()
    stack = [v.producer for v in values if v.producer is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(v.producer for v in node.input_values if v.producer is not None)
    return seen


def _is_optimizer_node(node: Node) -> bool:
    # graphpar.capture.optim tags every node it emits with this module path
    return node.module == "optimizer" or (node.module or "").startswith("optimizer.")


def forward_backward_optimizer(graph: Graph) -> tuple[set[Node], set[Node], set[Node]]:
    """(forward, backward, optimizer) node sets of a captured training step.

    Forward: the loss's ancestors, and the ancestors of buffer updates (batch-norm running
    statistics are computed by the forward pass). Optimizer: the nodes graphpar's optimizer
    appended, nodes that read optimizer state, and everything downstream of them. Backward:
    the rest. A graph with no loss output is not a training step: PassError.
    """
    losses = [o.value for o in graph.outputs if o.role is OutputRole.LOSS]
    if not losses:
        raise PassError(f"graph @{graph.name} has no loss output: pipeline stages are cut from "
                        "a training step (compile with --mode train)")
    buffers = {v.name for v in graph.inputs_with_role(Role.BUFFER)}
    roots = losses + [o.value for o in graph.outputs
                      if o.role is OutputRole.UPDATE and o.target in buffers]
    forward = _ancestors(roots)
    optimizer: set[Node] = set()
    for node in graph.nodes:  # topological: a node after an optimizer node is seen after it
        if node in forward:
            continue
        reads_state = any(v.is_input and v.role is Role.OPTIM_STATE for v in node.input_values)
        downstream = any(v.producer in optimizer for v in node.input_values)
        if _is_optimizer_node(node) or reads_state or downstream:
            optimizer.add(node)
    backward = {n for n in graph.nodes if n not in forward and n not in optimizer}
    return forward, backward, optimizer


def equal_flops_stages(graph: Graph, stages: int) -> dict[Node, int]:
    """A default assignment of the forward nodes: `stages` contiguous runs in topological
    order with about equal FLOPs (the stage DP replaces it). Each stage gets at least one
    node that does arithmetic; too few such nodes: PassError."""
    forward, _, _ = forward_backward_optimizer(graph)
    order = [n for n in graph.nodes if n in forward]
    flops = [node_flops(n) for n in order]
    heavy = sum(1 for f in flops if f > 0)
    if stages < 1 or stages > heavy:
        raise PassError(f"cannot cut graph @{graph.name} into {stages} stages: its forward has "
                        f"{heavy} ops that compute; choose between 1 and {heavy} stages")
    total = sum(flops)
    assignment: dict[Node, int] = {}
    stage, done, heavy_left = 0, 0.0, heavy
    for node, f in zip(order, flops):
        # move on once this stage holds its share, keeping one computing op per later stage
        if (f > 0 and stage < stages - 1 and done >= total * (stage + 1) / stages
                and heavy_left >= stages - stage - 1):
            stage += 1
        assignment[node] = stage
        done += f
        heavy_left -= f > 0
    return assignment


def _check_forward(graph: Graph, forward: set[Node], forward_stage: Mapping[Node, int]) -> None:
    missing = [n for n in graph.nodes if n in forward and n not in forward_stage]
    if missing:
        raise PassError(f"the stage assignment leaves {len(missing)} forward node(s) of graph "
                        f"@{graph.name} out, the first a {missing[0].op} "
                        f"({missing[0].module or 'no module'})")
    for node in forward:
        for v in node.input_values:
            if v.producer in forward and forward_stage[v.producer] > forward_stage[node]:
                raise PassError(
                    f"the stage assignment sends data backwards: {node.op} "
                    f"({node.module or 'no module'}) on stage {forward_stage[node]} reads a "
                    f"{v.producer.op} on stage {forward_stage[v.producer]}; forward stages must "
                    "be contiguous in topological order")


def follow_forward(graph: Graph, forward_stage: Mapping[Node, int]) -> dict[Node, int]:
    """Every node's stage, from the stages (or layers: any ordered integers) of the forward nodes.

    - A backward node goes where the forward op it differentiates is: the stage every forward
      value it reads is on (produced or used there), the latest such stage that is not after
      the gradient it receives (gradients flow to earlier stages only).
    - A backward node that reads no forward value follows the gradient it reads; a node that
      reads neither (a constant) goes with its first user.
    - An optimizer node goes to the stage of the parameter it updates (the stage of the
      parameter's first forward use); shared ones (Adam's step count) to the first such stage.
    """
    forward, backward, optimizer = forward_backward_optimizer(graph)
    _check_forward(graph, forward, forward_stage)
    stage: dict[Node, int] = {n: forward_stage[n] for n in forward}
    uses: dict[Value, set[int]] = {}  # where each forward value is produced or read forward
    for node in forward:
        for v in node.input_values:
            uses.setdefault(v, set()).add(stage[node])
        for v in node.outputs:
            uses.setdefault(v, set()).add(stage[node])

    deferred: list[Node] = []
    for node in graph.nodes:
        if node not in backward:
            continue
        bound = min((stage[v.producer] for v in node.input_values
                     if v.producer in backward and v.producer in stage), default=None)
        places = [uses[v] for v in node.input_values if v in uses]
        if not places:
            if bound is None:
                deferred.append(node)
            else:
                stage[node] = bound
            continue
        common = set.intersection(*places) or set.union(*places)
        if bound is not None:
            common = {s for s in common if s <= bound} or {bound}
        stage[node] = max(common)
    for node in reversed(deferred):  # constants: with their first user (clones where shared)
        users = [stage[u] for u in node.users if u in stage]
        stage[node] = min(users) if users else 0

    _follow_parameters(graph, forward, optimizer, stage)
    return {n: stage[n] for n in graph.nodes}


def parameter_stages(graph: Graph, stage: Mapping[Node, int]) -> dict[str, int]:
    """Each parameter's stage: where the forward first computes with it. Shape-only uses (a
    weight's transpose ahead of its matmul) are looked through to the op that does arithmetic;
    a parameter used only by shape ops goes with the first of them."""
    forward, _, _ = forward_backward_optimizer(graph)
    home: dict[str, int] = {}
    for param in graph.inputs_with_role(Role.PARAM):
        computing, direct, seen = [], [], set()
        stack = [(u, True) for u in param.users if u in forward]
        while stack:
            node, is_direct = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if is_direct:
                direct.append(stage[node])
            if node_flops(node) > 0:
                computing.append(stage[node])
            else:
                stack.extend((u, False) for u in node.users if u in forward)
        if computing or direct:
            home[param.name] = min(computing or direct)
    return home


def _follow_parameters(graph: Graph, forward: set[Node], optimizer: set[Node],
                       stage: dict[Node, int]) -> None:
    """Optimizer nodes join the stage of the parameter they update."""
    home = parameter_stages(graph, stage)
    params = {v.name for v in graph.inputs_with_role(Role.PARAM)}
    for out in graph.outputs:
        if out.role is OutputRole.UPDATE and out.target in params:
            where = home.get(out.target, 0)
            stack = [out.value.producer]
            while stack:
                node = stack.pop()
                if node in optimizer and node not in stage:
                    stage[node] = where
                    stack.extend(v.producer for v in node.input_values)
    for node in graph.nodes:  # optimizer nodes no parameter update reaches
        if node in optimizer and node not in stage:
            before = [stage[v.producer] for v in node.input_values if v.producer in stage]
            read = [home[v.name] for v in node.input_values if v.is_input and v.name in home]
            stage[node] = min(before + read, default=0)


def value_name(graph: Graph, value: Value) -> str:
    """A name for `value` that is stable across subgraphs of `graph`: an input keeps its name;
    a node result is `v<node index>` (`v<node index>.<result>` for multi-result nodes)."""
    if value.is_input:
        return value.name
    index = graph.nodes.index(value.producer)
    if len(value.producer.outputs) == 1:
        return f"v{index}"
    return f"v{index}.{value.index}"


def stage_subgraph(graph: Graph, nodes: Iterable[Node], name: str,
                   keep_order: bool = False) -> Graph:
    """A standalone graph of `nodes` (a subset of `graph`'s), in `graph`'s order (in the
    order given, a topological one, with `keep_order`).

    Values it reads from outside become inputs: a graph input keeps its name and role, a node
    result from outside is named by `value_name` with role INPUT. Its results used outside
    (by other nodes, or as the graph's own outputs) become outputs: graph outputs keep their
    role and target (a gradient or update output brings the input it names along, so the
    subgraph verifies); results only other nodes read are plain outputs whose `target` is
    their `value_name`, which is the input name the consuming subgraph gives them.
    """
    nodes = list(nodes)
    members = set(nodes)
    order = nodes if keep_order else [n for n in graph.nodes if n in members]
    sub = Graph(name, attrs=dict(graph.attrs), mesh=graph.mesh)
    mapping: dict[Value, Value] = {}
    by_name = graph.inputs_by_name()

    def bring(value: Value) -> Value:
        if value not in mapping:
            role = value.role if value.is_input else Role.INPUT
            fresh = sub.add_input(value_name(graph, value), value.type, role)
            fresh.layout = value.layout
            mapping[value] = fresh
        return mapping[value]

    for node in order:
        for v in node.input_values:
            if v.producer not in members:
                bring(v)
    copy_nodes(order, sub, mapping)
    for out in graph.outputs:
        if out.value.producer in members or (out.value.is_input and out.value in mapping):
            if out.role in (OutputRole.GRAD, OutputRole.UPDATE):
                bring(by_name[out.target])
            sub.outputs.append(Output(mapping[out.value], out.role, out.target))
    for node in order:
        for v in node.outputs:
            if any(u not in members for u in v.users):
                sub.add_output(mapping[v], OutputRole.OUTPUT, value_name(graph, v))
    return sub
