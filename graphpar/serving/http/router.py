"""The front of a served placement: one HTTP address for every device group, each request sent
to the least-loaded group holding its model (AlpaServe's controller: fewest requests in
flight).

Each group is a `graphpar serve` of its own models in its own process (graphpar.serving.http.app
in a :class:`~graphpar.serving.http.group.GroupServer`); the front reads only the request's
``model``, forwards the body untouched and streams the group's answer back byte for byte, so
every endpoint, error and stream chunk is the group server's own. A client that goes away
closes the forwarded request, and the group aborts it as it would its own client's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from graphpar.serving.http.protocol import error_body

__all__ = ["GroupAddress", "Router", "build_router"]


@dataclass
class GroupAddress:
    """A device group as the front sees it: its name, its server's URL, its models."""

    name: str
    url: str
    models: tuple[str, ...]
    in_flight: int = field(default=0)


class Router:
    """Least-loaded routing among the groups that hold a model (ties: the first group)."""

    def __init__(self, groups: Sequence[GroupAddress]) -> None:
        self.groups = list(groups)
        self.models = sorted({m for g in self.groups for m in g.models})

    def choose(self, model: str) -> GroupAddress | None:
        holders = [g for g in self.groups if model in g.models]
        return min(holders, key=lambda g: g.in_flight) if holders else None


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def build_router(groups: Sequence[GroupAddress], timeout_s: float = 600.0) -> FastAPI:
    """The front's FastAPI application over `groups` (their servers already listening)."""
    router = Router(groups)
    app = FastAPI(title="graphpar placement", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx2.AsyncClient(timeout=timeout_s)
    registry = CollectorRegistry()
    in_flight = Gauge("graphpar_router_requests_in_flight", "Requests forwarded to a group "
                      "and not yet answered in full", ["group"], registry=registry)
    routed = Counter("graphpar_router_requests", "Requests forwarded, by group and model",
                     ["group", "model"], registry=registry)
    for g in router.groups:
        in_flight.labels(g.name).set(0)

    async def forward(raw: Request) -> Response:
        body = await raw.body()
        try:
            data = json.loads(body)
        except ValueError as exc:
            return _error(400, f"the request body is not valid JSON: {exc}")
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str):
            return _error(400, f"model: required field missing (this server serves "
                               f"{', '.join(router.models)})", param="model")
        group = router.choose(model)
        if group is None:
            return _error(404, f"the model {model!r} does not exist: this server serves "
                               f"{', '.join(router.models)}", "not_found_error", "model",
                          "model_not_found")
        group.in_flight += 1
        in_flight.labels(group.name).set(group.in_flight)
        routed.labels(group.name, model).inc()
        request = client.build_request(
            "POST", group.url + raw.url.path, content=body,
            headers={"content-type": raw.headers.get("content-type", "application/json")})
        try:
            upstream = await client.send(request, stream=True)
        except BaseException:
            group.in_flight -= 1
            in_flight.labels(group.name).set(group.in_flight)
            raise

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # finished, or the client went away: close the group's request
                await upstream.aclose()
                group.in_flight -= 1
                in_flight.labels(group.name).set(group.in_flight)

        headers = {k: v for k, v in upstream.headers.items()
                   if k.lower() in ("retry-after", "cache-control")}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers,
                                 media_type=upstream.headers.get("content-type"))

    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "graphpar"}
            for m in router.models]})

    async def health() -> Response:
        down = []
        for g in router.groups:
            try:
                ok = (await client.get(g.url + "/health")).status_code == 200
            except httpx2.HTTPError:
                ok = False
            if not ok:
                down.append(g.name)
        if down:
            return _error(503, f"device group(s) {', '.join(down)} do not answer",
                          "server_error")
        return Response(status_code=200)

    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    app.post("/v1/completions")(forward)
    app.post("/v1/chat/completions")(forward)
    app.get("/v1/models")(list_models)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    return app
