"""The CPU reference executor: an interpreter that runs each node's torch reference in order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from graphpar.errors import GraphparError
from graphpar.ir.graph import Graph, Value
from graphpar.ir.ops import get_op
from graphpar.ir.verify import describe


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


def run(graph: Graph, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
        ) -> list[torch.Tensor]:
    """Execute `graph` on CPU tensors; returns the graph outputs in order.

    Intermediate tensors are dropped after their last use, so peak memory follows the
    graph's live set rather than its size.
    """
    env = bind_inputs(graph, inputs)
    last_use: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.input_values:
            last_use[v] = i
    keep = {out.value for out in graph.outputs}
    with torch.no_grad():
        for i, node in enumerate(graph.nodes):
            args = [env[v] if isinstance(v, Value) else v for v in node.inputs]
            try:
                result = get_op(node.op).reference(*args, **node.attrs)
            except Exception as exc:
                raise GraphparError(f"graph @{graph.name}, {describe(node, graph)} failed to "
                                    f"execute: {exc}") from exc
            results = result if isinstance(result, (tuple, list)) else (result,)
            for out, tensor in zip(node.outputs, results):
                env[out] = tensor
            for v in set(node.input_values):
                if last_use[v] == i and v not in keep and not v.is_input:
                    del env[v]
    return [env[out.value] for out in graph.outputs]
