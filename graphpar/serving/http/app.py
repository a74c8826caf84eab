"""The OpenAI-compatible routes (FastAPI) over one :class:`AsyncEngine` per served model, and
the uvicorn runner.

Every route answers either the OpenAI shape or OpenAI's error object with a 4xx naming the
field at fault (400 bad request, 404 unknown model or path, 429 overloaded with Retry-After);
a 500 is a bug. A streamed response is server-sent events, ``data: {...}`` per chunk and
``data: [DONE]`` last; a client that goes away aborts its requests (their KV blocks are freed
before the engine's next step).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from graphpar.errors import GenerationError
from graphpar.serving.async_engine import AsyncEngine, EngineDeadError, RequestRejected
from graphpar.serving.http.metrics import ServerMetrics
from graphpar.serving.http.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    echo_logprobs,
    error_body,
    new_id,
    usage,
)
from graphpar.serving.outputs import CompletionOutput, RequestOutput
from graphpar.serving.sampling import SamplingParams
from graphpar.serving.tokenizer import Tokenizer

__all__ = ["ServedModel", "build_app", "run"]

RETRY_AFTER_S = 1  # what a 429 tells a client to wait, seconds


@dataclass
class ServedModel:
    """A model the server answers for under ``name``: its engine loop and tokenizer."""

    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    created: int = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.info.max_model_len


def build_app(models: dict[str, ServedModel], metrics: ServerMetrics,
              max_waiting: int | None = None) -> FastAPI:
    """The FastAPI application serving ``models`` (their engine loops already started)."""
    app = FastAPI(title="graphpar", docs_url=None, redoc_url=None, openapi_url=None)
    server = _Routes(models, metrics, max_waiting)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(exc), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal server error (a graphpar bug: please report "
                                       f"it): {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    app.get("/health")(server.health)
    app.get("/v1/models")(server.list_models)
    app.get("/metrics")(server.metrics)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    return app


def _validation_error(exc: RequestValidationError) -> dict[str, Any]:
    """The first problem pydantic found, as one line naming the field."""
    errors = exc.errors()
    if not errors:
        return error_body("the request body is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return error_body(f"the request body is not valid JSON: {detail}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union's branch names ("str", "list[int]") are not fields: keep the field's path
    fields = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    param = ".".join(fields) or None
    message = first.get("msg", "invalid value")
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return error_body("the request body must be a JSON object (sent with Content-Type: "
                          "application/json)")
    if first.get("type") == "extra_forbidden":
        message = "unknown field (not an option of this endpoint)"
    elif first.get("type") == "missing":
        message = "required field missing"
    return error_body(f"{param or 'body'}: {message}", param=param)


class _Routes:
    def __init__(self, models: dict[str, ServedModel], metrics: ServerMetrics,
                 max_waiting: int | None) -> None:
        self.models = models
        self.metrics_ = metrics
        self.max_waiting = max_waiting

    # --- plain routes -------------------------------------------------------------------------

    async def health(self) -> Response:
        dead = [m for m in self.models.values() if not m.engine.alive]
        if dead:
            return JSONResponse(error_body(f"the engine of {dead[0].name} has stopped: "
                                           f"{dead[0].engine.error or 'shut down'}",
                                           "server_error"), status_code=503)
        return Response(status_code=200)

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "graphpar",
             "root": m.name, "max_model_len": m.max_model_len} for m in self.models.values()]}

    async def metrics(self) -> Response:
        return Response(self.metrics_.render(), media_type=CONTENT_TYPE_LATEST)

    # --- helpers ------------------------------------------------------------------------------

    def _model(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ApiError(400, f"model: required field missing (this server serves "
                                f"{', '.join(self.models)})", "model")
        model = self.models.get(name)
        if model is None:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves "
                                f"{', '.join(self.models)}", "model", code="model_not_found")
        return model

    def _admit(self, model: ServedModel, count: int) -> None:
        if not model.engine.alive:
            raise ApiError(503, f"the engine has stopped: {model.engine.error or 'shut down'}",
                           type="server_error")
        waiting = model.engine.num_unstarted
        if self.max_waiting is not None and waiting + count > self.max_waiting:
            raise ApiError(429, f"the server is overloaded: {waiting} requests are waiting "
                                f"(--max-waiting {self.max_waiting}); retry after "
                                f"{RETRY_AFTER_S} s", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    @staticmethod
    def _check(model: ServedModel, prompt: list[int], max_tokens: int | None,
               params: SamplingParams | None, field: str) -> None:
        """A 400 for a prompt the engine would refuse (before it reaches the engine)."""
        context = model.max_model_len
        if max_tokens is not None and len(prompt) + max_tokens > context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens, "
                                f"but {len(prompt) + max_tokens} were requested "
                                f"({len(prompt)} in the {field}, {max_tokens} for the "
                                f"completion); shorten the {field} or lower max_tokens",
                           field if len(prompt) >= context else "max_tokens",
                           code="context_length_exceeded")
        if params is None:
            return
        try:
            model.engine.engine.check_request(prompt, params)
        except GenerationError as exc:
            message = str(exc)
            param = "n" if "parallel samples" in message else \
                "logit_bias" if message.startswith("logit_bias") else field
            code = "context_length_exceeded" if "too long" in message else None
            raise ApiError(400, message, param, code=code) from None

    @staticmethod
    def _max_tokens(model: ServedModel, prompts: list[list[int]], asked: int | None,
                    field: str) -> int:
        longest = max(len(p) for p in prompts)
        if longest >= model.max_model_len:
            raise ApiError(400, f"the {field} has {longest} tokens, the model's context "
                                f"{model.max_model_len}: at most {model.max_model_len - 1} "
                                f"leave room for a new token", field,
                           code="context_length_exceeded")
        return model.max_model_len - longest if asked is None else asked

    def _start(self, model: ServedModel, prompts: list[list[int]], params: SamplingParams,
               request_id: str) -> list[AsyncIterator[RequestOutput]]:
        self._admit(model, len(prompts))
        arrival = time.perf_counter()
        return [model.engine.generate(p, params, f"{request_id}-{i}", arrival)
                for i, p in enumerate(prompts)]

    @staticmethod
    def _stream(model: ServedModel, request_id: str, count: int, chunks: AsyncIterator[dict],
                raw: Request) -> StreamingResponse:
        """Server-sent events of ``chunks``; when the client disconnects, its requests are
        aborted at once (not when the next chunk fails to send, which may be never)."""
        async def abort_on_disconnect() -> None:
            await _disconnected(raw)
            for i in range(count):
                model.engine.abort(f"{request_id}-{i}")

        watch = asyncio.ensure_future(abort_on_disconnect())
        return StreamingResponse(_sse(chunks, watch), media_type="text/event-stream")

    # --- completions --------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        model = self._model(body.model)
        body.check_supported()
        try:
            prompts = body.prompts(model.tokenizer.encode)
        except GenerationError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        max_tokens = self._max_tokens(model, prompts, body.max_tokens, "prompt")
        params = body.sampling_params(max_tokens)
        for prompt in prompts:
            self._check(model, prompt, max_tokens, params, "prompt")
        request_id = new_id("cmpl")
        streams = self._start(model, prompts, params, request_id)
        decode = model.tokenizer.decode
        echo = body.prompt_texts(decode) if body.echo else None
        if body.stream:
            chunks = _completion_chunks(request_id, model.name, streams, params, body.n,
                                        body.logprobs is not None, body.include_usage, decode,
                                        echo)
            return self._stream(model, request_id, len(prompts), chunks, raw)
        outputs = await _final(streams, raw, "prompt")
        if outputs is None:
            return Response(status_code=499)  # the client went away: nobody reads this
        return JSONResponse(completion_body(request_id, model.name, outputs, body.n,
                                            body.logprobs is not None, decode, echo))

    # --- chat ---------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        model = self._model(body.model)
        body.check_supported()
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt = model.tokenizer.apply_chat_template(messages)
        except GenerationError as exc:
            raise ApiError(400, str(exc), "messages") from None
        max_tokens = self._max_tokens(model, [prompt], body.requested_max_tokens, "messages")
        params = body.sampling_params(max_tokens)
        self._check(model, prompt, max_tokens, params, "messages")
        request_id = new_id("chatcmpl")
        streams = self._start(model, [prompt], params, request_id)
        decode = model.tokenizer.decode
        if body.stream:
            chunks = _chat_chunks(request_id, model.name, streams[0], params, body.logprobs,
                                  body.include_usage, decode)
            return self._stream(model, request_id, 1, chunks, raw)
        outputs = await _final(streams, raw, "messages")
        if outputs is None:
            return Response(status_code=499)
        return JSONResponse(chat_body(request_id, model.name, outputs[0], body.logprobs, decode))


# --- outputs as they come -------------------------------------------------------------------

async def _final(streams: list[AsyncIterator[RequestOutput]], raw: Request, field: str
                 ) -> list[RequestOutput] | None:
    """Every request's last output; None when the client disconnected first (then aborted)."""
    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        last_out = None
        async for out in stream:
            last_out = out
        assert last_out is not None
        return last_out

    results = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({results, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not results.done():
            results.cancel()  # each stream's generator aborts its request
            await asyncio.gather(results, return_exceptions=True)
    if results.cancelled():
        return None
    try:
        outputs = results.result()
    except RequestRejected as exc:
        raise ApiError(400, str(exc), field) from None
    except EngineDeadError as exc:
        raise ApiError(500, str(exc), type="server_error") from None
    for out in outputs:
        if out.error is not None:  # failed after it was admitted: not the client's doing
            raise ApiError(500, f"the request failed in the engine: {out.error}",
                           type="server_error")
    return outputs


async def _disconnected(raw: Request) -> None:
    """Return when the client has gone (the request's body is read already)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _merged(streams: list[AsyncIterator[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # the streams not finished abort their requests
        await asyncio.gather(*tasks, return_exceptions=True)


class _Delta:
    """What of one choice has been sent: text (held back while it may still change) and
    tokens."""

    def __init__(self, params: SamplingParams) -> None:
        # a stop string may be forming at the end of the text: hold that much back
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.text = 0
        self.tokens = 0
        self.done = False

    def next(self, c: CompletionOutput
             ) -> tuple[str, list[int], list[float], list | None] | None:
        """The new text, tokens, their logprobs and top logprobs (None unless asked) to send
        for ``c``; None when there is no new token. A new
        token whose text is held back still makes a chunk (with empty text), as in vLLM, so
        a client sees each token when it comes."""
        if self.done:
            return None
        text = c.text or ""
        if c.finish_reason is None:
            end = len(text) - self.holdback
            while end > self.text and text[end - 1] == "\ufffd":  # a character in pieces
                end -= 1
        else:
            end = len(text)
            self.done = True
        delta = text[self.text:end] if end > self.text else ""
        tokens = c.token_ids[self.tokens:]
        logprobs = c.logprobs[self.tokens:]
        tops = None if c.top_logprobs is None else c.top_logprobs[self.tokens:]
        if not tokens and not delta and c.finish_reason is None:
            return None
        self.text = max(self.text, end)
        self.tokens = len(c.token_ids)
        return delta, tokens, logprobs, tops


async def _completion_chunks(request_id: str, model: str,
                             streams: list[AsyncIterator[RequestOutput]], params: SamplingParams,
                             n: int, want_logprobs: bool, include_usage: bool,
                             decode: Callable[[list[int]], str], echo: list[str] | None = None
                             ) -> AsyncIterator[dict]:
    """Completion chunks as outputs come; ``echo``: each prompt's text, sent before the first
    token of each of its choices."""
    created = int(time.time())
    sent: dict[tuple[int, int], _Delta] = {}
    last: dict[int, RequestOutput] = {}
    echoed: set[tuple[int, int]] = set()

    def chunk(choices: list[dict], **extra: Any) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": model, "choices": choices, **extra}

    async for i, out in _merged(streams):
        last[i] = out
        if out.error is not None:
            raise ApiError(500, f"the request failed in the engine: {out.error}",
                           type="server_error")
        for c in out.outputs:
            state = sent.setdefault((i, c.index), _Delta(params))
            offset = state.text
            new = state.next(c)
            if new is None:
                continue
            text, tokens, logprobs, tops = new
            scores = None
            if want_logprobs:
                scores = completion_logprobs(tokens, logprobs, decode,
                                             offset + len(echo[i]) if echo else offset, tops)
            if echo and (i, c.index) not in echoed:  # the prompt, before the first tokens
                echoed.add((i, c.index))
                text = echo[i] + text
                if want_logprobs:
                    scores = echo_logprobs(out, c, decode, len(c.token_ids) - len(tokens))
            yield chunk([{"index": i * n + c.index, "text": text, "logprobs": scores,
                          "finish_reason": c.finish_reason}])
    if include_usage:
        yield chunk([], usage=usage([last[i] for i in sorted(last)]))


async def _chat_chunks(request_id: str, model: str, stream: AsyncIterator[RequestOutput],
                       params: SamplingParams, want_logprobs: bool, include_usage: bool,
                       decode: Callable[[list[int]], str]) -> AsyncIterator[dict]:
    created = int(time.time())
    sent: dict[int, _Delta] = {}
    last = None

    def chunk(choices: list[dict], **extra: Any) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices, **extra}

    async for _, out in _merged([stream]):
        last = out
        if out.error is not None:
            raise ApiError(500, f"the request failed in the engine: {out.error}",
                           type="server_error")
        for c in out.outputs:
            if c.index not in sent:
                sent[c.index] = _Delta(params)
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            new = sent[c.index].next(c)
            if new is None:
                continue
            text, tokens, logprobs, tops = new
            yield chunk([{"index": c.index, "delta": {"content": text} if text else {},
                          "logprobs": chat_logprobs(tokens, logprobs, decode, tops)
                          if want_logprobs else None,
                          "finish_reason": c.finish_reason}])
    if include_usage and last is not None:
        yield chunk([], usage=usage([last]))


async def _sse(chunks: AsyncIterator[dict], watch: asyncio.Future) -> AsyncIterator[str]:
    """Server-sent events: ``data: {...}`` per chunk, an error object if one comes up, and
    ``data: [DONE]``; ``watch`` (aborting on disconnect) is cancelled when the stream ends."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except ApiError as exc:
        yield f"data: {json.dumps(error_body(exc.message, exc.type, exc.param, exc.code))}\n\n"
    except RequestRejected as exc:
        yield f"data: {json.dumps(error_body(str(exc)))}\n\n"
    except EngineDeadError as exc:
        yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
    finally:
        watch.cancel()
    yield "data: [DONE]\n\n"


# --- the runner ---------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: one the system picks); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run(app: FastAPI, sock: socket.socket, on_ready: Callable[[], None] | None = None,
        graceful_s: float = 30.0) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM; in-flight requests are given
    ``graceful_s`` seconds to finish (uvicorn then raises the signal again, so the caller's
    own handling — exit 130 or 143 — follows)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=graceful_s, lifespan="off")
    server = uvicorn.Server(config)
    if on_ready is not None:
        startup = server.startup

        async def announce(sockets=None) -> None:
            await startup(sockets)
            if server.started:
                on_ready()
        server.startup = announce  # type: ignore[method-assign]
    server.run(sockets=[sock])


def start_in_thread(app: FastAPI, sock: socket.socket, timeout_s: float = 60.0) -> Any:
    """Serve ``app`` on ``sock`` from a daemon thread (a device group's server, whose process
    is stopped by its worker group, not by signals); returns the uvicorn server once it
    listens."""
    import threading

    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="graphpar-http")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the group's HTTP server did not start")
        time.sleep(0.01)
    return server
