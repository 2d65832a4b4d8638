"""A task beside a block: ``async with beside(coro): ...`` runs ``coro`` while the block
runs, then cancels it and waits for it to end.

A failure of the task before the block ended is raised when the block ends (its
cancellation is not). It lives in the leaf package because producers, consumers and ops
all use it (a keep-alive, a waiting record, a report while waiting, a watchdog) and may
not import each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def beside(coro: Coroutine[Any, Any, Any], name: str | None = None
                 ) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``coro`` as a task named ``name`` for the block (module docstring)."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
