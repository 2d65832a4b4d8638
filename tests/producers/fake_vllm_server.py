"""The fake vLLM (``tests.producers.fake_vllm``) on a real loopback port, for tests that
run the ``rollq`` CLI itself (which reaches its servers over HTTP, not a mock transport)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import uvicorn

from tests.producers.fake_vllm import FakeVLLM

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class FakeVLLMApp:
    """An ASGI app answering every request with ``FakeVLLM.handle``."""

    def __init__(self, fake: FakeVLLM) -> None:
        self.fake = fake

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        query = scope.get("query_string", b"").decode()
        url = f"{self.fake.base_url}{scope['path']}" + (f"?{query}" if query else "")
        request = httpx.Request(scope["method"], url, content=body,
                                headers=[(k.decode(), v.decode()) for k, v in scope["headers"]])
        response = await self.fake.handle(request)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()]})
        await send({"type": "http.response.body", "body": response.content})


@contextlib.asynccontextmanager
async def serve_fake(fake: FakeVLLM) -> AsyncIterator[str]:
    """Serve ``fake`` on a free loopback port; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(FakeVLLMApp(fake), host="127.0.0.1", port=port,
                                           log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(20):
            while not server.started:  # noqa: ASYNC110  uvicorn sets a flag, no event
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
