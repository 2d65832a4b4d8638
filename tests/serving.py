"""An ASGI app on a real uvicorn, on a free loopback port, inside the test's own event loop.

For tests that reach a server over HTTP as production does (the ``rollq`` CLI, an agent
that builds its own client) rather than through a mock transport: the fake vLLM
(``tests.producers.fake_vllm_server``) and the capturing gateway (``tests/agents``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from rollq.ops.local.stack import free_port


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, port: int | None = None, *,
                     start_timeout_s: float = 20.0) -> AsyncIterator[str]:
    """Serve ``app`` on ``port`` (a free one if None) until the block ends; yields its
    base URL once uvicorn has started (``TimeoutError`` after ``start_timeout_s``)."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(start_timeout_s):
            while not server.started:  # noqa: ASYNC110  uvicorn sets a flag, no event
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
