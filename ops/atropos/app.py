"""The Atropos trajectory API on rollq's streams: ``create_app(settings) -> FastAPI``.

Same paths, bodies, answers and status codes as atroposlib 0.4.0's ``run-api`` server, so
an env in ``serve`` mode and an Atropos trainer work by changing only the URL; what
differs is that every state change is in Redis before the answer (``ops.atropos.store``).
Differences a client can see (docs/guides/atropos.md lists them; ``tests/atropos/test_differential``
checks that everything else answers the same):

- a posted group that is not self-consistent (masks or scores of the wrong length,
  non-finite floats, ids out of range) is answered 422 with the reason and never stored;
  atroposlib stores it (per-token rows that merely do not fit their tokens are stored,
  kept verbatim, as atroposlib does: ``ops.atropos.convert.set_aside``);
- a group posted before any trainer registered is kept (atroposlib's ``/register`` then
  skips its set-up for good);
- ``/status-env`` for an env_id nobody registered is a 404, not a 500;
- a request that finds Redis unreachable is held and run again for up to
  ``outage_hold_s`` (``ops.atropos.outage``), then a 503;
- ``/batch`` acks the batch it handed out before only if that answer was sent in full;
  else it hands the same batch out again (``ops.atropos.store``);
- ``POST /ack-batch`` (new): ack the batch last handed out without asking for another;
- an identical re-post (same env, tokens and scores) within ``dedup_window_s`` is answered
  ``received`` and not stored again (atroposlib's env retries a post on 5xx/timeouts);
  identical groups inside one ``/scored_data_list`` are distinct posts;
- ``/batch`` answers gzip only to clients that ask for it (``Accept-Encoding``), joined
  from pieces deflated at post time (``ops.atropos.pieces``), never compressed per call.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson
import redis.asyncio as aioredis
import structlog
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollq.ops.atropos.convert import mismatched_fields
from rollq.ops.atropos.inference import add_inference_routes, inference_upstream
from rollq.ops.atropos.models import (
    EnvIdentifier,
    EnvRegistered,
    EnvStatus,
    RegisterEnv,
    ScoredData,
    ServerInfo,
    Status,
    TrainerRegistration,
)
from rollq.ops.atropos.outage import outage_riding_route, ride_out
from rollq.ops.atropos.pieces import compress, gzip_chunks, raw_chunks, raw_length
from rollq.ops.atropos.store import AtroposStore, NotRegistered, UnknownEnv
from rollq.ops.connections import open_redis, redis_options
from rollq.ops.role_metrics import add_metrics_route
from rollq.ops.settings import AtroposApiSettings
from rollq.schemas import ContractError, TransientError
from rollq.schemas.failures import classify

if TYPE_CHECKING:
    from rollq.ops.metrics import RoleMetrics

log = structlog.get_logger("rollq.atropos")

_EMPTY_EXAMPLE: dict[str, list[Any]] = {
    name: [] for name in ("tokens", "masks", "scores", "advantages", "ref_logprobs",
                          "generation_params", "inference_logprobs", "messages", "images")}


class JsonResponse(Response):
    """A JSON answer rendered with orjson (ints beyond 64 bits fall back to stdlib json)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        if isinstance(content, bytes):
            return content
        try:
            return orjson.dumps(content)
        except TypeError:  # /register's uuid is a 128-bit int, as atroposlib's
            import json

            return json.dumps(content, separators=(",", ":")).encode()


async def _client_left(receive: Receive) -> bool:
    """Whether the client has disconnected, without waiting: the server has a
    ``http.disconnect`` ready (request-body messages still queued are skipped)."""
    while True:
        message: Message | None = None
        with anyio.CancelScope() as scope:
            scope.cancel()
            message = await receive()
        if scope.cancelled_caught or message is None:
            return False  # nothing ready: the connection is open
        if message["type"] == "http.disconnect":
            return True


class ChunkedResponse(Response):
    """A JSON answer sent as a sequence of chunks with a known length: a 64-group batch is
    ~30 MB even gzipped, and joining it first would only copy it once more.

    ``on_sent(sent)`` is awaited when the answer is over: ``sent`` is True once the last
    byte was handed to the server with the client still connected (uvicorn drops writes
    to a gone client silently, so the connection is checked before the end)."""

    media_type = "application/json"

    def __init__(self, chunks: Iterable[bytes | memoryview], *, length: int | None = None,
                 headers: Mapping[str, str] | None = None,
                 on_sent: Callable[[bool], Awaitable[None]] | None = None) -> None:
        if length is None:
            chunks = list(chunks)
            length = sum(len(chunk) for chunk in chunks)
        self.chunks = chunks
        self.on_sent = on_sent
        super().__init__(headers={**(headers or {}), "content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = False
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            connected = not await _client_left(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            sent = connected
        finally:
            if self.on_sent is not None:
                await self.on_sent(sent)


class GzipRequests:
    """Inflate request bodies sent with ``Content-Encoding: gzip`` (as atroposlib's env
    client sends them); a body that is not gzip is a 400 ``Invalid gzip payload``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = MutableHeaders(scope=scope) if scope["type"] == "http" else None
        if headers is None or "gzip" not in headers.get("content-encoding", "").lower():
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            inflated = gzip.decompress(body) if body else b""
        except (OSError, EOFError):
            await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
            return
        headers["content-length"] = str(len(inflated))
        del headers["content-encoding"]
        sent = False

        async def inflated_receive() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": inflated, "more_body": False}

        await self.app(scope, inflated_receive, send)


_GROUP_LIST = TypeAdapter(list[ScoredData])
_BATCH_OPEN, _COMMA, _BATCH_CLOSE = (compress(text) for text in (b'{"batch":[', b",", b"]}"))
_VARY = {"Vary": "Accept-Encoding"}
_GZIPPED = {"Content-Encoding": "gzip", **_VARY}


def _accepts_gzip(request: Request) -> bool:
    """Whether the client takes gzip (``gzip`` in Accept-Encoding, not refused with q=0)."""
    for coding in request.headers.get("accept-encoding", "").lower().split(","):
        name, _, params = coding.strip().partition(";")
        if name.strip() == "gzip":
            quality = params.strip().removeprefix("q=") or "1"
            try:
                return float(quality) > 0
            except ValueError:
                return True
    return False


def _problem(status: int, detail: Any) -> JsonResponse:
    return JsonResponse({"detail": detail}, status_code=status)


async def _body(request: Request, model: type[BaseModel]) -> Any:
    return model.model_validate_json(await request.body())


OUTCOMES = ("rejected", "fields_set_aside", "batch_redelivered")
"""What ``rollq_atropos_events_total{event=…}`` counts, per API process: groups answered
422, groups stored with per-token rows set aside, batches handed out again."""


def _metrics(settings: AtroposApiSettings, events: Counter[str]) -> RoleMetrics:
    from rollq.ops.metrics import RoleMetrics

    metrics = RoleMetrics("atropos-api", run=settings.run, redis_url=settings.redis_url,
                          redis_options=redis_options(settings))
    for event in OUTCOMES:
        metrics.add_counter("rollq_atropos_events", "Atropos API events of this process: "
                            "groups rejected (422), groups with per-token rows set aside, "
                            "batches handed out again", lambda e=event: events[e], event=event)
    return metrics


def create_app(settings: AtroposApiSettings, *, redis: aioredis.Redis | None = None,
               transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The API for ``settings.run``. ``redis`` (tests) is used instead of opening a client
    from ``settings.redis_url``, and is then not closed here; ``transport`` reaches the
    inference servers (``settings.inference``, ``ops.atropos.inference``)."""
    events: Counter[str] = Counter()  # this process's, for /metrics (OUTCOMES)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # open_redis: the TLS files of the settings, and refusals named (exit 78)
        client = redis or open_redis(settings)
        try:
            async with AtroposStore(client, settings.run, rewards=settings.rewards,
                                    consumer_group=settings.consumer_group,
                                    partitions=settings.partitions,
                                    lock_timeout_s=settings.lock_timeout_s,
                                    gzip_level=settings.gzip_level,
                                    dedup_window_s=settings.dedup_window_s,
                                    piece_cache_bytes=settings.piece_cache_mb << 20,
                                    delivery_wait_s=settings.delivery_wait_s,
                                    events=events) as store, \
                    inference_upstream(settings.inference, model=settings.model or None,
                                       timeout_s=settings.request_timeout_s,
                                       transport=transport) as upstream:
                app.state.store = store
                app.state.upstream = upstream
                log.info("atropos_api_started", run=settings.run, rewards=settings.rewards,
                         partitions=store.partitions)
                yield
        finally:
            if redis is None:
                await client.aclose()

    app = FastAPI(title="rollq Atropos API", lifespan=lifespan,
                  default_response_class=JsonResponse)
    app.router.route_class = outage_riding_route(settings.outage_hold_s)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True,
                       allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(GZipMiddleware, minimum_size=1000, compresslevel=settings.gzip_level)
    app.add_middleware(GzipRequests)

    def store_of(request: Request) -> AtroposStore:
        store: AtroposStore = request.app.state.store
        return store

    @app.exception_handler(ValidationError)
    async def invalid_body(request: Request, exc: ValidationError) -> JsonResponse:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        return _problem(422, [{**e, "loc": ("body", *e["loc"])} for e in errors])

    @app.exception_handler(ContractError)
    async def invalid_data(request: Request, exc: ContractError) -> JsonResponse:
        events["rejected"] += 1
        log.warning("group_rejected", path=request.url.path, detail=str(exc))
        return _problem(422, str(exc))

    @app.exception_handler(TransientError)
    async def unavailable(request: Request, exc: TransientError) -> JsonResponse:
        failure = classify(exc)
        log.warning("request_failed", path=request.url.path, reason=failure.reason,
                    detail=failure.detail)
        return _problem(503, failure.detail)

    @app.exception_handler(UnknownEnv)
    async def unknown_env(request: Request, exc: UnknownEnv) -> JsonResponse:
        return _problem(404, str(exc))

    add_inference_routes(app)
    add_metrics_route(app, lambda: _metrics(settings, events))

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"message": "AtroposLib API"}

    @app.post("/register")
    async def register(registration: TrainerRegistration, request: Request) -> JsonResponse:
        requester = await store_of(request).register_trainer(registration.model_dump())
        return JsonResponse({"uuid": requester})

    @app.post("/register-env")
    async def register_env(body: RegisterEnv, request: Request) -> dict[str, Any]:
        env = {"max_context_len": body.max_token_length,
               "weight": body.weight if body.weight is not None else 1.0,
               "desired_name": body.desired_name,
               "min_batch_allocation": body.min_batch_allocation,
               "group_size": body.group_size}
        record = await store_of(request).register_env(env)
        if record is None:
            return {"status": "wait for trainer to start"}
        return EnvRegistered(status="success", env_id=record["registered_id"],
                             wandb_name=record["real_name"],
                             checkpoint_dir=record["checkpoint_dir"],
                             starting_step=record["starting_step"],
                             checkpoint_interval=record["checkpoint_interval"],
                             num_steps=record["num_steps"]).model_dump()

    @app.post("/disconnect-env")
    async def disconnect_env(body: EnvIdentifier, request: Request) -> dict[str, Any]:
        try:
            await store_of(request).disconnect_env(body.env_id)
        except UnknownEnv as exc:
            return {"status": "failure", "error": str(exc)}
        return {"status": "success"}

    @app.get("/wandb_info")
    async def wandb_info(request: Request) -> dict[str, Any]:
        registration = (await store_of(request).state()).get("registration")
        if registration is None:
            return {"group": None, "project": None}
        return {"group": registration["wandb_group"], "project": registration["wandb_project"]}

    @app.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        state = await store_of(request).state()
        registration = state.get("registration")
        if registration is None:
            return ServerInfo(max_token_len=int(state.get("max_token_len", -1))).model_dump()
        return ServerInfo(batch_size=registration["batch_size"],
                    max_token_len=registration["max_token_len"]).model_dump()

    @app.get("/batch")
    async def batch(request: Request) -> Response:
        try:
            handout = await store_of(request).next_batch()
        except NotRegistered:
            return JsonResponse({"status": "error",
                                 "message": "Trainer not registered. Call /register first.",
                                 "batch": []})
        if handout is None:
            return JsonResponse(b'{"batch":null}')
        pieces = [_BATCH_OPEN]
        for i, group in enumerate(handout.pieces):
            pieces += [_COMMA, group] if i else [group]
        pieces.append(_BATCH_CLOSE)
        store = store_of(request)

        async def on_sent(sent: bool) -> None:  # the next /batch acks it only if sent
            try:
                await ride_out(lambda: store.record_delivery(handout.handout, sent),
                               hold_s=settings.outage_hold_s, what="recording a delivery")
            except TransientError as exc:
                log.warning("delivery_not_recorded", run=settings.run, detail=str(exc),
                            consequence="the batch will be handed out again")

        if _accepts_gzip(request):  # joined, not compressed again (ops.atropos.pieces)
            return ChunkedResponse(gzip_chunks(pieces), headers=_GZIPPED, on_sent=on_sent)
        return ChunkedResponse(raw_chunks(pieces), length=raw_length(pieces), headers=_VARY,
                               on_sent=on_sent)

    @app.post("/ack-batch")
    async def ack_batch(request: Request) -> dict[str, Any]:
        """rollq's addition: ack the batch last handed out (after the optimizer step)."""
        acked = await store_of(request).ack_outstanding()
        return {"status": "acked", "groups": acked}

    @app.get("/latest_example")
    async def latest_example(request: Request) -> Response:
        latest = await store_of(request).latest()
        return JsonResponse(latest if latest is not None else _EMPTY_EXAMPLE)

    @app.post("/scored_data")
    async def scored_data(request: Request) -> dict[str, Any]:
        data = await _body(request, ScoredData)
        answer = await store_of(request).post(data)
        events["fields_set_aside"] += bool(mismatched_fields(data))
        return answer

    @app.post("/scored_data_list")
    async def scored_data_list(request: Request) -> dict[str, Any]:
        groups = _GROUP_LIST.validate_json(await request.body())
        store = store_of(request)
        for group in groups:  # all or nothing: one bad group and none is stored
            store.check(group)
        buffered = 0
        last_buffer_size: int | None = None
        seen: Counter[bytes] = Counter()
        for group in groups:  # identical groups of one list are distinct posts
            same = orjson.dumps([group.env_id, group.tokens, group.scores])
            result = await store.post(group, occurrence=seen[same])
            events["fields_set_aside"] += bool(mismatched_fields(group))
            seen[same] += 1
            if result["status"] == "buffered":
                buffered += 1
                last_buffer_size = result.get("buffer_size", last_buffer_size)
        response: dict[str, Any] = {"status": "received", "groups_processed": len(groups)}
        if buffered:
            response["buffered"] = buffered
            if last_buffer_size is not None:
                response["last_buffer_size"] = last_buffer_size
        return response

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        store = store_of(request)
        state = await store.state()
        return Status(current_step=int(state.get("step", 0)),
                      queue_size=await store.queue_size()).model_dump()

    @app.get("/status-env")
    async def status_env(request: Request) -> dict[str, Any]:
        body = await _body(request, EnvIdentifier)
        return EnvStatus(**await store_of(request).env_status(body.env_id)).model_dump()

    @app.get("/reset_data")
    async def reset_data(request: Request) -> PlainTextResponse:
        await store_of(request).reset()
        return PlainTextResponse("Reset successful", status_code=200)

    return app
