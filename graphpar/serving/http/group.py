"""A device group of a served placement: one worker process of the job protocol
(graphpar.runtime.jobs) that serves its models' engines over HTTP on a loopback port, for the
front (graphpar.serving.http.router) to forward requests to.

The worker is handed its engines already built (the CLI loads the models: the serving wing
reads no model files); its one command, ``serve``, starts their engine loops and the server and
replies with the port. The worker group stops the process, and the loops with it.
"""

from __future__ import annotations

import time
from pathlib import Path

from graphpar.runtime.jobs import JobWorker
from graphpar.runtime.workers import LOOPBACK
from graphpar.serving.async_engine import AsyncEngine
from graphpar.serving.engine import LLMEngine
from graphpar.serving.http.app import ServedModel, bind, build_app, start_in_thread
from graphpar.serving.http.metrics import ServerMetrics
from graphpar.serving.tokenizer import Tokenizer

__all__ = ["GroupServer"]


class GroupServer(JobWorker):
    """Rank 0 of a one-process job: its group's engines (served name -> engine)."""

    def __init__(self, jobdir: str | Path, rank: int, world: int,
                 engines: dict[str, LLMEngine], tokenizer: Tokenizer,
                 max_waiting: int | None = None) -> None:
        super().__init__(jobdir, rank, world)
        self.engines, self.tokenizer, self.max_waiting = engines, tokenizer, max_waiting
        self.server = None

    def serve(self) -> int:
        """Start the engine loops and the HTTP server on 127.0.0.1; returns its port."""
        metrics = ServerMetrics()
        models = {}
        for name, engine in self.engines.items():
            metrics.update(name, engine, [])
            loop = AsyncEngine(engine, lambda e, outputs, name=name:
                               metrics.update(name, e, outputs))
            models[name] = ServedModel(name, loop, self.tokenizer, int(time.time()))
            loop.start()
        sock = bind(LOOPBACK, 0)
        self.server = start_in_thread(build_app(models, metrics, self.max_waiting), sock)
        return sock.getsockname()[1]
