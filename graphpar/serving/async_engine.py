"""One engine loop serving many asyncio callers: requests come in from any coroutine, each
step's new tokens go out to each request's stream (vLLM's AsyncLLM over its engine core, here a
thread of the same process).

The :class:`~graphpar.serving.engine.LLMEngine` is not thread-safe, so only the loop's thread
touches it: callers send commands (add, abort, stop) through a queue, and the loop hands each
request's outputs to the caller's event loop with ``call_soon_threadsafe``. Every connection's
requests share the one engine, so the engine batches across connections (continuous batching).
A caller that stops listening (a client that disconnects) aborts its request: the loop finishes
it and the scheduler frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from graphpar.errors import GenerationError, GraphparError
from graphpar.serving.engine import LLMEngine, RequestOutput
from graphpar.serving.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestRejected"]

class RequestRejected(GenerationError):
    """The engine refused a request when it was added (bad tokens, too long, never fits)."""


class EngineDeadError(GraphparError):
    """The engine loop stopped on an error (a bug, or a tensor-parallel rank that died)."""


_ABORTED = object()  # the end of an aborted request's stream


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException | object) -> None:
        _deliver(self.loop, [(self.queue, item)])


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    """Hand items to their queues on ``loop``: one wake-up of the loop for all of them. The
    engine's thread never waits for the loop; a closed loop (nobody listens) drops them."""
    def put_all() -> None:
        for q, item in items:
            q.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the caller's loop is closed
        pass


class AsyncEngine:
    """An :class:`LLMEngine` stepped by a background thread, fed from asyncio coroutines.

    ``on_iteration(engine, outputs)`` runs on the loop's thread after each iteration (outputs:
    what the step returned, possibly nothing); the server updates its metrics there.
    """

    def __init__(self, engine: LLMEngine,
                 on_iteration: Callable[[LLMEngine, list[RequestOutput]], None] | None = None
                 ) -> None:
        self.engine = engine
        self.on_iteration = on_iteration
        self.error: str | None = None
        self.num_unstarted = 0  # requests added whose first output has not come (event loop)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # the loop thread's only
        self._thread = threading.Thread(target=self._run, name="graphpar-engine", daemon=True)
        self._ids = 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Abort what is left, stop the loop and wait for it."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread): its blocks are freed before the next step, and
        its stream ends without a finished output."""
        self._commands.put(("abort", request_id))

    def new_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it runs (every token so far), the last one ``finished``.

        Raises RequestRejected when the engine refuses it, EngineDeadError when the loop died.
        Leaving the iteration early (the client went away) aborts the request.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine has stopped: {self.error or 'shut down'}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self._commands.put(("add", request_id, prompt, params, arrival, stream))
        self.num_unstarted += 1
        started = finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # Outputs hold every token so far: when several steps' outputs wait (the
                # event loop fell behind the engine), the latest stands for them all, and the
                # caller sends one chunk with their tokens instead of one per token.
                while isinstance(item, RequestOutput) and not item.finished and \
                        not stream.queue.empty():
                    item = stream.queue.get_nowait()
                if item is _ABORTED:
                    finished = True  # nothing left to abort
                    return
                if isinstance(item, BaseException):
                    raise item
                if not started:
                    started = True
                    self.num_unstarted -= 1
                finished = item.finished
                yield item
        finally:
            if not started:
                self.num_unstarted -= 1
            if not finished:
                self.abort(request_id)

    # --- the loop's thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block for a command only when there is nothing to step.
                commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command[0] == "stop":
                        self._stop()
                        return
                    self._handle(command)
                outputs = []
                if engine.has_unfinished_requests():
                    outputs = engine.step(stream=True)
                by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        by_loop.setdefault(stream.loop, []).append((stream.queue, out))
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        engine.discard_request(out.request_id)  # the server keeps nothing
                for loop, items in by_loop.items():  # one wake-up per step and event loop
                    _deliver(loop, items)
                if self.on_iteration is not None:
                    self.on_iteration(engine, outputs)
        except BaseException as exc:  # a bug or a dead rank: fail every caller, say why
            self.error = f"{type(exc).__name__}: {exc}"
            dead = EngineDeadError(f"the engine stopped: {self.error}")
            for stream in self._streams.values():
                stream.put(dead)
            self._streams.clear()

    def _handle(self, command: tuple[Any, ...]) -> None:
        engine = self.engine
        if command[0] == "add":
            _, request_id, prompt, params, arrival, stream = command
            try:
                engine.add_request(prompt, params, request_id=request_id, arrival_time=arrival)
                error = engine.requests[request_id].error
            except GraphparError as exc:  # not token ids: the server checks, but never die
                error = str(exc)
            if error is not None:  # refused at once: no output, nothing kept
                engine.discard_request(request_id)
                stream.put(RequestRejected(error))
            else:
                self._streams[request_id] = stream
        elif command[0] == "abort":
            request_id = command[1]
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                # Its blocks are freed now; its output (finish reason "abort") comes out of the
                # next step, for the metrics, and nobody receives it.
                engine.abort_request(request_id)
                stream.put(_ABORTED)  # a caller still waiting stops waiting

    def _stop(self) -> None:
        for request_id in list(self._streams):
            self._handle(("abort", request_id))
        outputs = []
        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
        if self.on_iteration is not None:
            self.on_iteration(self.engine, outputs)
