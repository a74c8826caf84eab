"""Where a plan breaks: the first node of the sharded graph whose value leaves its rounding bound.

When a plan's outputs differ from eager PyTorch beyond rounding (`check.eager`), the
difference started somewhere. `first_difference` runs the plan's device program again, in this
process, returning every value it computes; puts each back together from its shards (its
layout says how); and compares it, node by node in graph order, with the same node of the
single-device graph run by the reference interpreter in float64, whose rounding companions
(`rounding.Rounding`) give every value its own bound, as for the outputs. The
first value beyond its bound is where the plan first differs: a collective that sums wrongly,
a shard that computes an op wrongly, a reshard between the wrong layouts.

When no value differs, the device program computes what the single-device graph does, and the
difference is between that graph and eager PyTorch: in the capture or an op's reference, not
in the plan; or, for `--lower cuda`, in the CUDA listing that ran instead of the program.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.compiler.check.eager import SAMPLES, Reference, reference_of
from graphpar.compiler.check.rounding import float64_run, to_float64
from graphpar.ir.graph import Graph, Node, OutputRole, Value
from graphpar.ir.printer import node_numbers
from graphpar.ir.types import TensorType

if TYPE_CHECKING:
    from graphpar.capture import Captured

__all__ = ["Difference", "first_difference", "first_node_beyond", "node_values",
           "pipeline_difference", "state_before"]


class Difference:
    """The first value of a graph that leaves its bound: its node, where and by how much."""

    def __init__(self, graph: Graph, node: Node, output: int, index: tuple[int, ...],
                 error: float, bound: float) -> None:
        self.graph, self.node, self.output = graph, node, output
        self.index, self.error, self.bound = index, error, bound

    def __str__(self) -> str:
        numbers = node_numbers(self.graph)
        node, value = self.node, self.node.outputs[self.output]
        name = f"%{numbers[node] + self.output}"
        operands = ", ".join(_operand(v, numbers) for v in node.inputs)
        text = f"{name} = {node.op}({operands})"
        if node.op == "reshard":
            text += f" {_reshard_text(node, self.graph)}"
        elif value.layout is not None:
            text += f" {value.layout}"
        origin = node.input_values[0].producer if node.op == "reshard" else None
        loc = node.loc or (origin.loc if origin is not None else None)
        where = ", ".join(x for x in (loc, node.module) if x)
        if where:
            text += f" ({where})"
        text += (f": element [{', '.join(map(str, self.index))}] off by {self.error:.2e}, "
                 f"bound {self.bound:.2e}")
        before = _reshard_before(node)
        if before is not None and node.op != "reshard":
            text += (f"; its input was resharded by %{numbers[before]} "
                     f"{_reshard_text(before, self.graph)}")
        return text


def _reshard_text(node: Node, graph: Graph) -> str:
    """`{P,R} -> {S(1),R} (reduce_scatter over mesh axis 0)`: a reshard and the collectives
    it is lowered to."""
    from graphpar.cost.communication import resharding_cost

    (source,) = node.input_values
    text = f"{source.layout} -> {node.output.layout}"
    if graph.mesh is None or source.layout is None or node.output.layout is None:
        return text
    cost = resharding_cost(source.type.shape, source.type.itemsize, source.layout,
                           node.output.layout, graph.mesh)
    steps = [f"{step.kind.value} over mesh axis {', '.join(map(str, step.axes))}"
             for step in cost.steps]
    return text + (f" ({', then '.join(steps)})" if steps else "")


def _operand(v, numbers: dict[Node, int]) -> str:
    if not isinstance(v, Value):
        return repr(v)
    if v.producer is None:
        return f"%{v.name}"
    return f"%{numbers[v.producer] + v.index}"


def _reshard_before(node: Node) -> Node | None:
    """The nearest reshard upstream of `node` (breadth first through its operands)."""
    seen, queue = set(), deque(v.producer for v in node.input_values if v.producer is not None)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "reshard":
            return n
        queue.extend(v.producer for v in n.input_values if v.producer is not None)
    return None


def _returning_every_value(graph: Graph) -> tuple[Graph, int]:
    """A copy of `graph` that also returns every node's results, in graph order, after its
    own outputs (whose count is returned)."""
    probe = graph.copy()
    count = len(probe.outputs)
    for node in probe.nodes:
        for out in node.outputs:
            probe.add_output(out, OutputRole.OUTPUT)
    return probe, count


def node_values(graph: Graph, inputs: dict[str, torch.Tensor], samples: int = SAMPLES
                ) -> Reference:
    """Every node result of `graph` run by the reference interpreter in float64, keyed
    ("value", "i") in graph order, with the spread of `samples` rounding companions."""
    probe, count = _returning_every_value(graph)
    as64 = probe.copy(map_type=lambda t: TensorType(t.shape, torch.float64)
                      if t.dtype == torch.float32 else t)
    named = {k: to_float64(v) for k, v in inputs.items()}

    def run(seed: int | None) -> list[dict]:
        with float64_run(seed):
            values = Interpreter(as64).run(named)[count:]
        return [{("value", str(i)): v for i, v in enumerate(values)}]
    return reference_of(run, samples)


def _reduce(tensors, op: str) -> torch.Tensor:
    """A partial value's reduction in float64, written apart from the runtime's own
    (`runtime.comm.reduce_tensors`), so that a bug there cannot hide here."""
    stacked = torch.stack([t.double() for t in tensors])
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    total = stacked.sum(0)
    return total / len(tensors) if op == "avg" else total


def first_difference(captured: Captured, args: Sequence[torch.Tensor],
                     state: dict[str, torch.Tensor] | None = None, samples: int = SAMPLES
                     ) -> str:
    """Where the device program of `captured`'s sharded graph first differs from the graph
    itself on `args` (module docstring), in one line; from `state` (parameters, optimizer
    state: those a later step starts from) instead of the captured state."""
    named = {**captured.bind(*args), **(state or {})}
    found = first_node_beyond(captured.graph, named, samples)
    return found or NO_NODE


NO_NODE = ("no node: every value of the device program equals the single-device graph within "
           "rounding, so the difference is between that graph and eager PyTorch (the capture "
           "or an op's reference), or in a CUDA listing that ran instead of the program")


def first_node_beyond(graph: Graph, named: dict[str, torch.Tensor], samples: int = SAMPLES
                      ) -> str | None:
    """The first value of sharded `graph` (global shapes, layouts, on its mesh) whose device
    program's result, made whole, leaves its bound on the inputs `named` (global tensors by
    input name); None when every value is within."""
    from graphpar.passes.lower_spmd import lower_graph
    from graphpar.runtime.spmd import run_spmd_in_process, shard_tensor, unshard

    mesh = graph.mesh
    reference = node_values(graph, named, samples)
    probe, count = _returning_every_value(graph)
    program = lower_graph(probe)
    per_rank = [{v.name: shard_tensor(named[v.name], v.layout, mesh, device)
                 for v in program.inputs} for device in range(mesh.size)]
    ran = run_spmd_in_process(program, per_rank, mesh)
    values = [out for node in graph.nodes for out in node.outputs]
    owners = [(node, k) for node in graph.nodes for k in range(len(node.outputs))]
    for i, (out, (node, k)) in enumerate(zip(program.outputs[count:], owners)):
        if not values[i].type.dtype.is_floating_point:
            continue
        got = unshard([rank[count + i] for rank in ran], out.value.layout, mesh, check=False,
                      reduce=_reduce)
        beyond = _beyond(got, reference, ("value", str(i)))
        if beyond is not None:
            return str(Difference(graph, node, k, *beyond))
    return None


def state_before(graph: Graph, state: dict[str, torch.Tensor],
                 steps: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`state` with the updates of `steps` (each step's outputs of `graph`) applied in turn:
    what the step after them starts from."""
    state = dict(state)
    for outputs in steps:
        for out, t in zip(graph.outputs, outputs):
            if out.role is OutputRole.UPDATE:
                state[out.target] = t
    return state


def _beyond(got: torch.Tensor, reference: Reference, key, step: int = 0
            ) -> tuple[tuple[int, ...], float, float] | None:
    """(index, error, bound) of `got`'s element furthest beyond its bound in `reference`, or
    None when every element is within."""
    want = reference.values[step][key].double()
    got = got.double()
    error = torch.where((got == want) | (got.isnan() & want.isnan()), 0.0, (got - want).abs())
    bound = reference.bound(step, key)
    beyond = torch.nan_to_num(error / bound.clamp(min=torch.finfo(torch.float64).tiny),
                              nan=float("inf"))
    beyond = torch.where(error == 0, 0.0, beyond)
    if not beyond.numel() or float(beyond.max()) <= 1.0:
        return None
    j = int(beyond.flatten().argmax())
    index = tuple(int(x) for x in torch.unravel_index(torch.tensor(j), beyond.shape))
    return index, float(error.flatten()[j]), float(bound.flatten()[j])


PHASES = {"F": "forward", "B": "backward", "I": "input-gradient backward",
          "W": "weight-gradient backward", "U": "update"}


def pipeline_difference(pipe, state: dict[str, torch.Tensor] | None = None,
                        samples: int = SAMPLES) -> str:
    """Where a pipelined step first differs, stage by stage: its step run again in this
    process on the example, every phase (a stage's forward, backward, update) is compared, in
    the order it ran, with its own single-device program run in float64 on the same inputs;
    the first phase beyond its bound is named (with, for a stage sharded on a sub-mesh, the
    first node of its plan that differs). When every phase computes what its program says,
    the values that crossed between stages are compared with what their stage computed.
    `state`: the state to start from, as `first_difference`'s."""
    from graphpar.runtime.pipeline import run_in_process, split_microbatches

    spec = pipe.spec
    names = pipe.captured.user_inputs
    inputs = split_microbatches(dict(zip(names, (*spec.inputs, *spec.targets))),
                                pipe.microbatches)
    records: list[tuple] = []
    run_in_process(pipe.programs, pipe.schedule, {**pipe.captured.state, **(state or {})},
                   inputs, pipe.sharded,
                   observe=lambda *record: records.append(record))
    for stage, phase, m, args, results in records:
        if m not in (0, None):
            continue
        graph = pipe.programs.stages[stage].program(phase)
        reference = _phase_outputs(graph, args, samples)
        for k, got in enumerate(results):
            if not got.is_floating_point():
                continue
            beyond = _beyond(got, reference, ("output", str(k)))
            if beyond is None:
                continue
            out = graph.outputs[k]
            what = (f"stage {stage}'s {PHASES[phase]}"
                    + (f" of microbatch {m}" if m is not None else "")
                    + f", output {k} ({out.role.value} {out.target or ''}".rstrip() + ")"
                    + f": element [{', '.join(map(str, beyond[0]))}] off by "
                      f"{beyond[1]:.2e}, bound {beyond[2]:.2e}")
            phased = (pipe.sharded.get(stage) or {}).get(phase)
            if phased is not None:
                node = first_node_beyond(phased.global_graph, dict(args), samples)
                if node is not None:
                    what += f"; on its sub-mesh {phased.mesh}, the plan first differs at {node}"
            return what
    produced: dict[tuple, tuple[int, torch.Tensor]] = {}  # a microbatch's values by name
    crossing = [r for r in records if r[2] is not None]  # the update reads state, not sends
    for stage, phase, m, _args, results in crossing:
        graph = pipe.programs.stages[stage].program(phase)
        for out, t in zip(graph.outputs, results):
            if out.target is not None:
                produced.setdefault((m, out.target), (stage, t))
    for stage, phase, m, args, _ in crossing:
        for name, t in args.items():
            source = produced.get((m, name))
            if source is not None and source[0] != stage and not torch.equal(source[1], t):
                return (f"%{name} of microbatch {m} arrives at stage {stage}'s {PHASES[phase]} "
                        f"different from what stage {source[0]} computed")
    return ("no stage: every phase computes what its program says on its inputs and every "
            "value crossing between stages arrives as computed, so the difference is in how "
            "the microbatches combine (gradient accumulation) or in the stage programs "
            "themselves (the split of the step)")


def _phase_outputs(graph: Graph, args: dict[str, torch.Tensor], samples: int) -> Reference:
    as64 = graph.copy(map_type=lambda t: TensorType(t.shape, torch.float64)
                      if t.dtype == torch.float32 else t)
    named = {k: to_float64(v) for k, v in args.items()}

    def run(seed: int | None) -> list[dict]:
        with float64_run(seed):
            outputs = Interpreter(as64).run(named)
        return [{("output", str(k)): t for k, t in enumerate(outputs)}]
    return reference_of(run, samples)
