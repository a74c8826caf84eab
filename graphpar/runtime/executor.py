"""A graph prepared for repeated execution: the interpreter in its serving configuration."""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.backends.interpreter import Communicating, Interpreter
from graphpar.ir.graph import Graph

__all__ = ["CompiledGraph"]


class CompiledGraph(Interpreter):
    """``run(inputs)`` = ``reference.run(graph, inputs)``, for a graph run hundreds of times a
    second (a serving engine's steps): prepared once, under ``torch.inference_mode``.

    ``checked``: graph inputs whose shape and dtype are checked on each call (the ones that
    change between calls); the others are trusted after the first call. ``comm``: this rank's
    :class:`~graphpar.runtime.comm.Communicator` for a device program with collectives.
    """

    def __init__(self, graph: Graph, checked: Iterable[str] = (),
                 comm: Communicating | None = None) -> None:
        super().__init__(graph, comm, checked=checked, inference=True)
