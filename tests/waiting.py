"""Waiting on conditions, not on the clock: the one polling helper of the test suite.

A loaded CI machine stretches every step, so a test never asserts that something happened
within N polls or N seconds of work. It waits until the condition holds, with a deadline
far above any plausible delay (the deadline only turns a hang into a failure with a name).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

DEADLINE_S = 120.0
"""Default deadline: generous, because reaching it means the test is broken, not slow."""


async def until(check: Callable[[], Any | Awaitable[Any]], what: str = "the condition",
                timeout_s: float = DEADLINE_S, every_s: float = 0.02) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy, and return that.

    Fails the test naming ``what`` after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(every_s)
