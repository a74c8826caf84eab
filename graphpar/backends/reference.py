"""The CPU reference executor: run an IR graph once with each node's torch reference."""

from __future__ import annotations

import torch

from graphpar.backends.interpreter import Communicating, Inputs, Interpreter, node_error
from graphpar.ir.graph import Graph

__all__ = ["node_error", "run"]


def run(graph: Graph, inputs: Inputs, comm: Communicating | None = None
        ) -> list[torch.Tensor]:
    """Execute `graph` on CPU tensors (`inputs` by name or in order); returns the graph outputs
    in order.

    Intermediate tensors are dropped after their last use, so peak memory follows the
    graph's live set rather than its size.

    `comm` (a `graphpar.runtime.comm.Communicator`) runs a device program as one rank of a
    mesh: its SPMD ops (collectives, `local_*` steps, send/recv; `graphpar.ir.spmd_ops`)
    go to the communicator. Without one, those ops only run for groups of one and otherwise
    raise `BackendError`. To run one graph many times, keep an
    :class:`~graphpar.backends.interpreter.Interpreter`.
    """
    return Interpreter(graph, comm).run(inputs)
