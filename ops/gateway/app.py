"""``create_app(settings)``: the gateway's FastAPI app (uvicorn only at the CLI edge).

Every route is ``CaptureHub.dispatch`` (``producers.inference.capture.hub`` documents the
routes, the streaming and the error statuses): the OpenAI bodies pass through as the agent
and the server wrote them (a proxy does not re-model a foreign API's many fields; the
capture layer reads what it needs and ``tests/agents`` pins the replies against the
``openai`` package's models). The lifespan opens the inference pool and a task that drops
episodes idle past ``episode_ttl_s``; with ``sessions`` also the run's Redis, the
``SessionHost`` behind ``/sessions`` (``ops.gateway.sessions``) and a task that
dead-letters session groups idle past ``session_ttl_s`` (a Redis outage there is logged
and tried again next round, never the gateway's end).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import redis.asyncio as aioredis
import structlog
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from rollq.ops.gateway.sessions import add_session_routes
from rollq.ops.role_metrics import add_metrics_route, gateway_metrics, session_metrics
from rollq.ops.settings import GatewaySettings
from rollq.producers.inference import InferencePool
from rollq.producers.inference.capture import CaptureHub, Upstream
from rollq.producers.inference.capture.render import LocalTemplate
from rollq.producers.publisher import Publisher
from rollq.producers.rollout import PolicyVersionSource
from rollq.producers.sessions import SessionGate, SessionHost, SessionStore
from rollq.schemas import TransientError

log = structlog.get_logger("rollq.gateway")

if TYPE_CHECKING:
    from rollq.ops.metrics import RoleMetrics


def create_app(settings: GatewaySettings, *,
               transport: httpx.AsyncBaseTransport | None = None,
               redis: aioredis.Redis | None = None) -> FastAPI:
    """The gateway app; ``transport`` reaches the vLLM servers (tests: a fake); ``redis``
    (tests) serves the sessions instead of a client opened from ``redis_url`` (and is
    then not closed here)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        template = (LocalTemplate.load(settings.tokenizer, settings.chat_template)
                    if settings.tokenizer else None)  # a bad path fails before any request
        async with InferencePool(settings.inference, model=settings.model,
                                 timeout_s=settings.request_timeout_s,
                                 max_retries=settings.max_retries, transport=transport) as pool:
            hub = CaptureHub(Upstream(pool, template=template),
                             episode_ttl_s=settings.episode_ttl_s,
                             tool_parser=settings.tool_parser,
                             continuation_check=settings.continuation_check)
            app.state.hub = hub
            app.state.retry_after_s = settings.retry_after_s
            async with contextlib.AsyncExitStack() as stack:
                tasks = [asyncio.create_task(_expire(hub, min(60.0, settings.episode_ttl_s)))]
                if settings.sessions:
                    host = app.state.sessions = await stack.enter_async_context(
                        open_sessions(settings, hub.upstream, redis=redis))
                    tasks.append(asyncio.create_task(
                        _expire_sessions(host, min(30.0, settings.session_ttl_s / 4))))
                log.info("gateway_started", inference=list(settings.inference),
                         local_render=template is not None, sessions=settings.sessions)
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="rollq gateway", lifespan=lifespan)
    add_metrics_route(app, lambda: _metrics(app, settings))
    add_session_routes(app)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def route(request: Request, path: str) -> Any:
        hub: CaptureHub = request.app.state.hub
        reply = await hub.dispatch(request.method, "/" + path, await request.body())
        if reply.events is not None:
            return StreamingResponse(reply.events, status_code=reply.status,
                                     media_type="text/event-stream")
        return Response(reply.content(), status_code=reply.status,
                        media_type="application/json")

    return app


def _metrics(app: FastAPI, settings: GatewaySettings) -> RoleMetrics:
    from rollq.ops.connections import redis_options
    from rollq.ops.metrics import RoleMetrics

    # the run-wide series (drops by reason: session_expired) only where it uses Redis
    metrics = RoleMetrics("gateway", run=settings.run,
                          redis_url=settings.redis_url if settings.sessions else None,
                          redis_options=redis_options(settings))
    gateway_metrics(lambda: getattr(app.state, "hub", None), settings.inference)(metrics)
    session_metrics(lambda: getattr(app.state, "sessions", None))(metrics)
    return metrics


@contextlib.asynccontextmanager
async def open_sessions(settings: GatewaySettings, upstream: Upstream, *,
                        redis: aioredis.Redis | None = None) -> AsyncIterator[SessionHost]:
    """The run's ``SessionHost`` on ``redis`` (None: a client of ``redis_url``, closed
    after); the run is registered (its partition count) before the first request."""
    from rollq.ops.connections import open_redis

    client = redis if redis is not None else open_redis(settings)
    try:
        publisher = Publisher(client, settings.run, settings.partitions)
        partitions = await publisher.register()
        yield SessionHost(
            store=SessionStore(client, settings.run),
            gate=SessionGate(client, settings.run, max_staleness=settings.max_staleness,
                             batch_groups=settings.batch_groups),
            upstream=upstream, partitions=partitions,
            policy_version=PolicyVersionSource(client, settings.run),
            session_ttl_s=settings.session_ttl_s, call_timeout_s=settings.request_timeout_s,
            tool_parser=settings.tool_parser, continuation_check=settings.continuation_check)
    finally:
        if redis is None:
            await client.aclose()


async def _expire_sessions(host: SessionHost, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await host.expire()
        except TransientError as exc:  # Redis away: the next round tries again
            log.warning("session_expiry_failed", error=str(exc))
        except Exception:  # a bug: said loudly, and the gateway keeps serving
            log.exception("session_expiry_failed")


async def _expire(hub: CaptureHub, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        hub.expire()
