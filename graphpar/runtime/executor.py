"""A graph prepared for repeated execution: the reference executor's loop, lookups done once.

:func:`graphpar.backends.reference.run` resolves each node's op, operands and last uses on every
call; a serving engine runs the same few graphs hundreds of times a second, so
:class:`CompiledGraph` does that work once: every value gets a slot in a flat list, every node
becomes (reference function, operand slots, attributes, result slots, slots to free). Running it
executes the same torch references in the same order as the reference executor (tests check the
two agree), with no per-node dictionary work. With a communicator (one rank of a device
program), collectives and rank-local steps go to it, as in the reference executor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graphpar.backends.reference import node_error
from graphpar.errors import GraphparError
from graphpar.ir.graph import Graph, Value
from graphpar.ir.ops import get_op
from graphpar.ir.spmd_ops import SPMD_OPS

__all__ = ["CompiledGraph"]

class CompiledGraph:
    """``run(inputs)`` = ``reference.run(graph, inputs)``, with the per-call lookups hoisted.

    ``checked``: graph inputs whose shape and dtype are checked on each call (the ones that
    change between calls); the others are trusted after the first call. ``comm``: this rank's
    :class:`~graphpar.runtime.comm.Communicator` for a device program with collectives.
    """

    def __init__(self, graph: Graph, checked: tuple[str, ...] = (), comm=None) -> None:
        self.graph = graph
        slot: dict[Value, int] = {}
        for v in graph.values():
            slot[v] = len(slot)
        self.size = len(slot)
        self.inputs = [(v.name, slot[v], v.type) for v in graph.inputs]
        self.checked = set(checked)
        last_use: dict[Value, int] = {}
        for i, node in enumerate(graph.nodes):
            for v in node.input_values:
                last_use[v] = i
        keep = {o.value for o in graph.outputs}
        self.steps = []
        for i, node in enumerate(graph.nodes):
            operands = tuple((True, slot[v]) if isinstance(v, Value) else (False, v)
                             for v in node.inputs)
            frees = tuple(slot[v] for v in set(node.input_values)
                          if last_use[v] == i and v not in keep and not v.is_input)
            if node.op in SPMD_OPS:
                if comm is None:
                    raise GraphparError(f"graph @{graph.name} communicates ({node.op}): run it "
                                        "with a communicator")
                fn, attrs = _communicating(comm, node, i), {}
            else:
                fn, attrs = get_op(node.op).reference, dict(node.attrs)
            self.steps.append((fn, operands, attrs, tuple(slot[o] for o in node.outputs),
                               frees, node))
        self.outputs = [slot[o.value] for o in graph.outputs]
        self._first = True

    def run(self, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        env: list = [None] * self.size
        for name, index, ty in self.inputs:
            try:
                tensor = inputs[name]
            except KeyError:
                raise GraphparError(f"graph @{self.graph.name}: no tensor given for input "
                                    f"%{name}") from None
            if (self._first or name in self.checked) and (
                    tuple(tensor.shape) != ty.shape or tensor.dtype != ty.dtype):
                raise GraphparError(f"graph @{self.graph.name}: input %{name} expects {ty}, got "
                                    f"{tuple(tensor.shape)} {tensor.dtype}")
            env[index] = tensor
        self._first = False
        # inference_mode: no autograd bookkeeping at all (cheaper than no_grad per op); cache
        # tensors made outside it can still be written in place.
        with torch.inference_mode():
            for fn, operands, attrs, outs, frees, node in self.steps:
                args = [env[x] if is_value else x for is_value, x in operands]
                try:
                    result = fn(*args, **attrs)
                except Exception as exc:
                    raise node_error(self.graph, node, exc) from exc
                if len(outs) == 1:
                    env[outs[0]] = result
                else:
                    for o, r in zip(outs, result):
                        env[o] = r
                for f in frees:
                    env[f] = None
        return [env[i] for i in self.outputs]


def _communicating(comm, node, index: int):
    def run(*args):
        return comm.execute(node, args, index=index)
    return run
