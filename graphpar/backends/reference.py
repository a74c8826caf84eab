"""The CPU reference executor: an interpreter that runs each node's torch reference in order."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from graphpar.errors import BackendError, GraphparError
from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.ops import get_op
from graphpar.ir.spmd_ops import COMM_OPS, LOCAL_OPS  # also registers the SPMD ops
from graphpar.ir.verify import describe

if TYPE_CHECKING:
    from graphpar.runtime.spmd import Communicator


def bind_inputs(graph: Graph, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
                ) -> dict[Value, torch.Tensor]:
    """Match tensors to graph inputs, by name or in order, checking shapes and dtypes."""
    if not isinstance(inputs, Mapping):
        if len(inputs) != len(graph.inputs):
            raise GraphparError(f"graph @{graph.name} takes {len(graph.inputs)} inputs, "
                                f"got {len(inputs)}")
        inputs = {v.name: t for v, t in zip(graph.inputs, inputs)}
    env: dict[Value, torch.Tensor] = {}
    for v in graph.inputs:
        if v.name not in inputs:
            raise GraphparError(f"graph @{graph.name}: no tensor given for input %{v.name}")
        tensor = inputs[v.name]
        if tuple(tensor.shape) != v.type.shape or tensor.dtype != v.type.dtype:
            raise GraphparError(
                f"graph @{graph.name}: input %{v.name} expects {v.type}, got "
                f"{tuple(tensor.shape)} {tensor.dtype}")
        env[v] = tensor
    return env


def run(graph: Graph, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        comm: Communicator | None = None) -> list[torch.Tensor]:
    """Execute `graph` on CPU tensors; returns the graph outputs in order.

    Intermediate tensors are dropped after their last use, so peak memory follows the
    graph's live set rather than its size.

    `comm` (a `graphpar.runtime.spmd.Communicator`) runs a device program as one rank of a
    mesh: its SPMD ops (collectives, `local_*` steps, send/recv; `graphpar.ir.spmd_ops`)
    go to the communicator. Without one, those ops only run for groups of one and otherwise
    raise `BackendError`.
    """
    with torch.no_grad():
        steps = interpret(graph, inputs, comm)
        try:
            request = next(steps)
            while True:
                index, node, args = request
                try:
                    result = comm.execute(node, args, index=index)  # type: ignore[union-attr]
                except Exception as exc:
                    raise node_error(graph, node, exc) from exc
                request = steps.send(result)
        except StopIteration as done:
            return done.value


def interpret(graph: Graph, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
              comm: Communicator | None = None
              ) -> Generator[tuple[int, Node, list], torch.Tensor, list[torch.Tensor]]:
    """The interpreter loop as a generator: runs local nodes itself and, with a `comm`,
    yields `(node index, node, operands)` for each communicating node (collectives,
    send/recv), to be resumed with its result; returns the graph outputs.

    `run` answers each request with `comm.execute`; the in-process SPMD executor
    (`graphpar.runtime.spmd.run_spmd_in_process`) drives one generator per rank and answers
    a collective once every member of its group has reached it. Callers wrap the loop in
    `torch.no_grad()` (a generator must not: interleaved generators would restore grad mode
    out of order).
    """
    env = bind_inputs(graph, inputs)
    last_use: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.input_values:
            last_use[v] = i
    keep = {out.value for out in graph.outputs}
    for i, node in enumerate(graph.nodes):
        args = [env[v] if isinstance(v, Value) else v for v in node.inputs]
        if comm is not None and node.op in COMM_OPS:
            result = yield i, node, args
        else:
            try:
                if comm is not None and node.op in LOCAL_OPS:
                    result = comm.execute(node, args, index=i)
                else:
                    result = get_op(node.op).reference(*args, **node.attrs)
            except Exception as exc:
                raise node_error(graph, node, exc) from exc
        results = result if isinstance(result, (tuple, list)) else (result,)
        for out, tensor in zip(node.outputs, results):
            env[out] = tensor
        for v in set(node.input_values):
            if last_use[v] == i and v not in keep and not v.is_input:
                del env[v]
    return [env[out.value] for out in graph.outputs]


def node_error(graph: Graph, node: Node, exc: Exception) -> GraphparError:
    """The error for a node that failed: names the graph and node; a BackendError (an SPMD op
    without a communicator, a failed collective) stays one."""
    cls = BackendError if isinstance(exc, BackendError) else GraphparError
    return cls(f"graph @{graph.name}, {describe(node, graph)} failed to execute: {exc}")
