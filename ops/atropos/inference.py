"""The Atropos API's inference routes: what atroposlib's ``vllm`` server type calls, on stock
vLLM, with the server's own token ids and logprobs (``rollq atropos-api --inference URL``).

An env in ``serve`` mode is pointed at ``http://<api>/inference/v1`` with
``server_type: vllm``; atroposlib then calls, under ``http://<api>/inference``:

- ``POST /generate``: token ids in, token ids and logprobs out
  (``producers.inference.capture.generate``: through the capture layer to
  ``/v1/completions``);
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: passed through (any ``n``);
- ``GET /health`` (its health probe) and ``GET /v1/models``.

The servers are one pool (balanced, health-checked, waited out while paused for a weight
update), like a worker's. Errors: the server's own 4xx status and message, 503 when no
server could answer after the pool's retries (atroposlib retries), 502 for a reply that
lacks the token ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollq.producers.inference import InferencePool
from rollq.producers.inference.capture import Upstream
from rollq.producers.inference.capture.generate import generate, passthrough
from rollq.producers.inference.errors import InferenceRequestError, InferenceResponseError
from rollq.schemas import InferenceUnavailable

PREFIX = "/inference"


@contextlib.asynccontextmanager
async def inference_upstream(urls: list[str], *, model: str | None, timeout_s: float,
                             transport: httpx.AsyncBaseTransport | None = None,
                             ) -> AsyncIterator[Upstream | None]:
    """The pool of ``urls`` as an ``Upstream`` while the block runs; None without urls."""
    if not urls:
        yield None
        return
    async with InferencePool(urls, model=model, timeout_s=timeout_s,
                             transport=transport) as pool:
        yield Upstream(pool)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


async def _answer(request: Request, path: str) -> Response:
    upstream: Upstream | None = request.app.state.upstream
    if upstream is None:
        return _error(404, "no inference servers: start the API with --inference URL",
                      "not_found_error")
    try:
        body = orjson.loads(await request.body())
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
    except ValueError as exc:
        return _error(400, f"invalid JSON body: {exc}", "invalid_request_error")
    try:
        reply: Any = (await generate(upstream, body) if path == "/generate"
                      else await passthrough(upstream, path, body))
    except InferenceRequestError as exc:
        return _error(exc.status, exc.server_message, "invalid_request_error")
    except InferenceUnavailable as exc:
        return _error(503, f"inference unavailable: {exc}", "service_unavailable")
    except InferenceResponseError as exc:
        return _error(502, str(exc), "upstream_error")
    return Response(orjson.dumps(reply), media_type="application/json")


def add_inference_routes(app: FastAPI) -> None:
    """Serve the routes of the module docstring from ``app.state.upstream``."""

    @app.post(PREFIX + "/generate")
    async def generate_route(request: Request) -> Response:
        return await _answer(request, "/generate")

    @app.post(PREFIX + "/v1/chat/completions")
    async def chat_route(request: Request) -> Response:
        return await _answer(request, "/v1/chat/completions")

    @app.post(PREFIX + "/v1/completions")
    async def completions_route(request: Request) -> Response:
        return await _answer(request, "/v1/completions")

    @app.get(PREFIX + "/health")
    async def health(request: Request) -> Response:
        if request.app.state.upstream is None:
            return _error(404, "no inference servers", "not_found_error")
        return Response(status_code=200)

    @app.get(PREFIX + "/v1/models")
    async def models(request: Request) -> Response:
        upstream: Upstream | None = request.app.state.upstream
        if upstream is None:
            return _error(404, "no inference servers", "not_found_error")
        try:
            info = await upstream.pool.model_info()
        except InferenceUnavailable as exc:
            return _error(503, f"inference unavailable: {exc}", "service_unavailable")
        return JSONResponse({"object": "list", "data": [{
            "id": info.name, "object": "model", "created": 0, "owned_by": "rollq",
            "max_model_len": info.max_model_len}]})
