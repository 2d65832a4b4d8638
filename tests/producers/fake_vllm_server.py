"""The fake vLLM (``tests.producers.fake_vllm``) on a real loopback port, for tests that
run the ``rollq`` CLI itself (which reaches its servers over HTTP, not a mock transport)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from tests.producers.fake_vllm import FakeVLLM
from tests.serving import serve_asgi

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
    async with serve_asgi(FakeVLLMApp(fake)) as url:
        yield url
