"""An httpx transport that forwards to the real server and keeps every JSON reply."""

from __future__ import annotations

from typing import Any

import httpx
import orjson


class RecordingTransport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[str, dict[str, Any], Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        body = await response.aread()
        if request.url.path.startswith(("/v1/", "/tokenize")):
            sent = orjson.loads(request.content) if request.content else {}
            self.exchanges.append((request.url.path, sent, orjson.loads(body)))
        return httpx.Response(response.status_code, headers=response.headers, content=body,
                              request=request)

    def replies(self, path: str) -> list[Any]:
        return [reply for p, _, reply in self.exchanges if p == path]
