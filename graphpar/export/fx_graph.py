"""An IR graph back as an `fx.GraphModule` of ATen ops: the inverse of capture.

The graph is printed as plain torch code (`torch_program.graph_function`, one torch call per
node), and that code is traced by `make_fx` on fake tensors of the graph's input types: the
result computes what the IR graph computes, in the ATen ops torch.export would have produced,
with each node's `meta["val"]` set, which is what torch-mlir's FX importer reads.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphpar.errors import UnsupportedOpError
from graphpar.export.torch_program import graph_function
from graphpar.ir.graph import Graph
from graphpar.ir.spmd_ops import SPMD_OPS

__all__ = ["graph_module"]


def graph_module(graph: Graph) -> torch.fx.GraphModule:
    """`graph` (a global graph: no collectives) as an fx.GraphModule whose placeholders are the
    graph's inputs in order and whose output is the tuple of its outputs."""
    spmd = next((n for n in graph.nodes if n.op in SPMD_OPS), None)
    if spmd is not None:
        raise UnsupportedOpError(f"graph @{graph.name} communicates ({spmd.op}): rebuild the "
                                 "global graph or a stage's, not a device program")
    namespace = {"torch": torch, "DEVICE": torch.device("cpu")}
    exec(compile(graph_function(graph, "run"), f"<graphpar @{graph.name}>", "exec"), namespace)
    run, names = namespace["run"], [v.name for v in graph.inputs]

    def step(*tensors):
        return tuple(run(dict(zip(names, tensors))))

    examples = [torch.empty(v.type.shape, dtype=v.type.dtype) for v in graph.inputs]
    return make_fx(step, tracing_mode="fake")(*examples)
