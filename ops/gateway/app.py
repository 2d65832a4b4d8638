"""``create_app(settings)``: the gateway's FastAPI app (uvicorn only at the CLI edge).

Every route is ``CaptureHub.dispatch`` (``producers.inference.capture.hub`` documents the
routes, the streaming and the error statuses): the OpenAI bodies pass through as the agent
and the server wrote them (a proxy does not re-model a foreign API's many fields; the
capture layer reads what it needs and ``tests/agents`` pins the replies against the
``openai`` package's models). The lifespan opens the inference pool and a task that drops
episodes idle past ``episode_ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import structlog
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ops.gateway.settings import GatewaySettings
from ops.role_metrics import add_metrics_route, gateway_metrics
from producers.inference import InferencePool
from producers.inference.capture import CaptureHub, Upstream
from producers.inference.capture.render import LocalTemplate

log = structlog.get_logger("rollq.gateway")

if TYPE_CHECKING:
    from ops.metrics import RoleMetrics


def create_app(settings: GatewaySettings, *,
               transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The gateway app; ``transport`` reaches the vLLM servers (tests: a fake)."""

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
            sweeper = asyncio.create_task(_expire(hub, min(60.0, settings.episode_ttl_s)))
            log.info("gateway_started", inference=list(settings.inference),
                     local_render=template is not None)
            try:
                yield
            finally:
                sweeper.cancel()
                await asyncio.gather(sweeper, return_exceptions=True)

    app = FastAPI(title="rollq gateway", lifespan=lifespan)
    add_metrics_route(app, lambda: _metrics(app, settings))

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
    from ops.metrics import RoleMetrics

    metrics = RoleMetrics("gateway", run=settings.run, redis_url=None)  # it uses no Redis
    gateway_metrics(lambda: getattr(app.state, "hub", None), settings.inference)(metrics)
    return metrics


async def _expire(hub: CaptureHub, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        hub.expire()
