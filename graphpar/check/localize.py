"""Where a plan breaks: the first node of the sharded graph whose value leaves its rounding bound.

When a plan's outputs differ from eager PyTorch beyond rounding (`graphpar.check.eager`), the
difference started somewhere. `first_difference` runs the plan's device program again, in this
process, returning every value it computes; puts each back together from its shards (its
layout says how); and compares it, node by node in graph order, with the same node of the
single-device graph run by the reference interpreter in float64, whose rounding companions
(`graphpar.check.rounding.Rounding`) give every value its own bound, as for the outputs. The
first value beyond its bound is where the plan first differs: a collective that sums wrongly,
a shard that computes an op wrongly, a reshard between the wrong layouts.

When no value differs, the device program computes what the single-device graph does, and the
difference is between that graph and eager PyTorch: in the capture or an op's reference, not
in the plan; or, for `--lower cuda`, in the CUDA listing that ran instead of the program.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.check.eager import SAMPLES, Reference, reference_of
from graphpar.check.rounding import float64_run, to_float64
from graphpar.ir.graph import Graph, Node, OutputRole, Value
from graphpar.ir.printer import node_numbers
from graphpar.ir.types import TensorType

if TYPE_CHECKING:
    from graphpar.api import Compiled

__all__ = ["Difference", "first_difference", "node_values"]


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


def first_difference(compiled: Compiled, samples: int = SAMPLES) -> str:
    """Where `compiled`'s device program first differs from its single-device graph on the
    example it was compiled from (module docstring), in one line."""
    from graphpar.passes.lower_spmd import lower_graph
    from graphpar.runtime.spmd import run_spmd_in_process, shard_tensor, unshard

    graph, mesh = compiled.captured.graph, compiled.mesh
    named = compiled.captured.bind(*compiled.example_args())
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
        key = ("value", str(i))
        want = reference.values[0][key]
        error = (got.double() - want.double()).abs()
        error = torch.where((got.double() == want.double()) | (got.isnan() & want.isnan()),
                            0.0, error)
        bound = reference.bound(0, key)
        beyond = torch.nan_to_num(error / bound.clamp(min=torch.finfo(torch.float64).tiny),
                                  nan=float("inf"))
        beyond = torch.where(error == 0, 0.0, beyond)
        if beyond.numel() and float(beyond.max()) > 1.0:
            j = int(beyond.flatten().argmax())
            index = tuple(int(x) for x in torch.unravel_index(torch.tensor(j), beyond.shape))
            return str(Difference(graph, node, k, index, float(error.flatten()[j]),
                                  float(bound.flatten()[j])))
    return ("no node: every value of the device program equals the single-device graph within "
            "rounding, so the difference is between that graph and eager PyTorch (the capture "
            "or an op's reference), or in a CUDA listing that ran instead of the program")
