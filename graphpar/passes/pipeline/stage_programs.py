"""A microbatch training graph split into per-stage programs: forward F, backward B (or its
input-gradient part I and weight-gradient part W), optimizer update U, and what crosses stages.

Each program is a standalone IR graph (`partition.stage_subgraph`) whose inputs are named: a
graph input keeps its name, a value made elsewhere is `partition.value_name`. A runtime runs a
stage's programs per microbatch in one environment of named tensors (what the stage received,
what its forward stashed for its backward, the microbatch's own inputs) and sends by name:

- `send_forward[s]`: what stage s sends to s + 1 after F, every value made by the forward of
  stages <= s that a later stage reads (values for stages further on are relayed);
- `send_backward[s]`: what stage s sends to s - 1 after B (or I), every value an earlier
  stage's backward reads that stages >= s made (gradients, and forward values that only a
  later stage had);
- `grads[s]`: backward values the optimizer reads, accumulated over microbatches; U gets
  their mean (the loss is a mean over the batch, so the batch gradient is the mean of the
  microbatch gradients); `grad_transfers` moves the ones another stage's U reads.

Values that do not depend on the microbatch (constants, Adam's step count, a weight's
transpose) are not sent or stashed: every program that reads one recomputes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from graphpar.errors import PassError
from graphpar.ir.graph import Graph, Node, Role, Value
from graphpar.ir.pipeline_programs import PHASES, PipelinePrograms, StageProgram
from graphpar.ir.types import TensorType
from graphpar.passes.pipeline.partition import (
    forward_backward_optimizer,
    stage_subgraph,
    value_name,
)

# the programs' types live in graphpar.ir.pipeline_programs (the runtime runs them); their names
# stay importable from here, where the compiler builds them
__all__ = ["PHASES", "PipelinePrograms", "StageProgram", "split_stages"]

_MAX_RECOMPUTE = 64  # nodes: a microbatch-independent value with a larger cone is sent instead


def _phase_of(node: Node, forward: set[Node], backward: set[Node]) -> str:
    return "F" if node in forward else "B" if node in backward else "U"


def _static_nodes(graph: Graph) -> set[Node]:
    """Nodes whose results do not depend on the microbatch: they read no user input."""
    static: set[Node] = set()
    for node in graph.nodes:
        if all((v.role is not Role.INPUT) if v.is_input else (v.producer in static)
               for v in node.input_values):
            static.add(node)
    return static


def _cone(node: Node) -> list[Node]:
    seen, stack = {node}, [node]
    while stack:
        for v in stack.pop().input_values:
            if v.producer is not None and v.producer not in seen:
                seen.add(v.producer)
                stack.append(v.producer)
    return list(seen)


def split_stages(graph: Graph, stage_of: Mapping[Node, int], zero_bubble: bool = True
                 ) -> PipelinePrograms:
    """Every stage's F, B (and with `zero_bubble`, I and W) and U programs for `graph`, a
    training step captured at the microbatch size, with stages from `follow_forward`.

    Raises PassError for a dependence no pipeline can honour (a forward that reads a later
    stage, a gradient that flows to a later stage's backward)."""
    forward, backward, _ = forward_backward_optimizer(graph)
    stages = max(stage_of.values()) + 1
    static = _static_nodes(graph)
    groups: dict[tuple[int, str], list[Node]] = {}
    for node in graph.nodes:
        groups.setdefault((stage_of[node], _phase_of(node, forward, backward)), []).append(node)

    def where(v: Value) -> tuple[int, str]:
        return stage_of[v.producer], _phase_of(v.producer, forward, backward)

    # Each group's members: its nodes and the microbatch-independent cones it recomputes.
    members: dict[tuple[int, str], set[Node]] = {}
    for key, nodes in groups.items():
        own = set(nodes)
        for node in nodes:
            for v in node.input_values:
                p = v.producer
                if p is not None and p not in own and p in static:
                    cone = _cone(p)
                    if len(cone) <= _MAX_RECOMPUTE:
                        own.update(cone)
        members[key] = own

    types: dict[str, TensorType] = {}
    forward_hops: list[set[str]] = [set() for _ in range(stages)]  # sent s -> s+1
    backward_hops: list[set[str]] = [set() for _ in range(stages)]  # sent s -> s-1
    needed_by_backward: list[set[str]] = [set() for _ in range(stages)]
    grads: list[set[str]] = [set() for _ in range(stages)]
    grad_transfers: set[tuple[int, int, str]] = set()
    for (s, phase), own in members.items():
        for node in own:
            for v in node.input_values:
                if v.producer is None or v.producer in own:
                    continue
                name = value_name(graph, v)
                types[name] = v.type
                ps, pphase = where(v)
                _route(graph, v, name, (ps, pphase), (s, phase), forward_hops, backward_hops,
                       needed_by_backward, grads, grad_transfers)

    programs = []
    for s in range(stages):
        fwd = _subgraph(graph, members.get((s, "F")), f"stage{s}_forward")
        bwd_nodes = members.get((s, "B"))
        bwd = _subgraph(graph, bwd_nodes, f"stage{s}_backward")
        input_grad = weight_grad = None
        if zero_bubble and bwd_nodes:
            i_nodes = _input_grad_part(graph, bwd_nodes, backward_hops[s])
            input_grad = _subgraph(graph, i_nodes, f"stage{s}_input_grad")
            weight_grad = _subgraph(graph, bwd_nodes - i_nodes, f"stage{s}_weight_grad")
            if weight_grad is not None:  # what W reads from I is kept with the microbatch
                needed_by_backward[s].update(
                    v.name for v in weight_grad.inputs if v.role is Role.INPUT)
        for g in (bwd, input_grad, weight_grad):
            if g is not None:
                needed_by_backward[s].update(v.name for v in g.inputs if v.role is Role.INPUT)
        upd = _subgraph(graph, members.get((s, "U")), f"stage{s}_update")
        for g in (fwd, bwd, input_grad, weight_grad, upd):
            for v in g.inputs if g is not None else ():
                types.setdefault(v.name, v.type)
        programs.append(StageProgram(
            s, fwd, bwd, input_grad, weight_grad, upd,
            send_forward=tuple(sorted(forward_hops[s])),
            send_backward=tuple(sorted(backward_hops[s])),
            keep_after_forward=frozenset(needed_by_backward[s] | backward_hops[s]),
            grads=tuple(sorted(grads[s]))))
    return PipelinePrograms(graph, dict(stage_of), tuple(programs), types,
                            tuple(sorted(grad_transfers)))


def _route(graph, v, name, source, dest, forward_hops, backward_hops, needed_by_backward,
           grads, grad_transfers) -> None:
    """Record how `v`, made by `source` (stage, phase), reaches `dest` (stage, phase)."""
    (ps, pphase), (s, phase) = source, dest
    what = f"{v.producer.op} ({v.producer.module or 'no module'})"
    if phase == "U":
        if pphase != "B":
            raise PassError(f"the optimizer update on stage {s} reads {what}, made by the "
                            f"{'forward' if pphase == 'F' else 'update'} of stage {ps}: only "
                            "gradients cross into an update")
        grads[ps].add(name)
        if ps != s:
            grad_transfers.add((ps, s, name))
        return
    if phase == "F" and pphase != "F":
        raise PassError(f"the forward of stage {s} reads {what} from a backward or update")
    if pphase == "F":
        if ps > s and phase == "F":
            raise PassError(f"the forward of stage {s} reads {what} from the later stage {ps}")
        for hop in range(ps, s):  # forward: relayed through every stage between
            forward_hops[hop].add(name)
        for hop in range(s + 1, ps + 1):  # a forward value only a later stage made
            backward_hops[hop].add(name)
        return
    if ps < s:
        raise PassError(f"the backward of stage {s} reads {what} from the backward of the "
                        f"earlier stage {ps}, which runs after it")
    for hop in range(s + 1, ps + 1):
        backward_hops[hop].add(name)


def _subgraph(graph: Graph, nodes: Iterable[Node] | None, name: str) -> Graph | None:
    nodes = set(nodes or ())
    if not nodes:
        return None
    sub = stage_subgraph(graph, nodes, name)
    return sub if sub.outputs else None


def _input_grad_part(graph: Graph, nodes: set[Node], sent: set[str]) -> set[Node]:
    """The backward nodes the previous stage waits for: the ancestors (within `nodes`) of
    what the stage sends back."""
    roots = [n for n in nodes for v in n.outputs if value_name(graph, v) in sent]
    part: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in part:
            continue
        part.add(node)
        stack.extend(v.producer for v in node.input_values if v.producer in nodes)
    return part
