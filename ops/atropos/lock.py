"""The lock that serialises the Atropos API's state changes across its processes.

Batch assembly, env registration, status and reset read the state and write it back, so
one of them at a time runs per run, whichever API process serves it: a Redis key taken
with SET NX PX (expiring after ``timeout_s``, so a killed holder cannot keep it) and
released only by its holder's token. An asyncio lock in front keeps this process's own
requests from polling Redis against each other. A release that Redis did not get (it was
down) is tried again before the next take: with AOF the key survives a Redis restart, and
would otherwise block every request of the run until it expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from rollq.consumers.bus import translated_errors
from rollq.schemas import BrokerUnavailable

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ApiLock:
    """The Redis lock at ``key``; ``async with lock.held():``."""

    def __init__(self, redis: aioredis.Redis, key: str, timeout_s: float) -> None:
        self.redis = redis
        self.key = key
        self.timeout_s = timeout_s
        self._local = asyncio.Lock()
        self._unreleased: set[str] = set()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the lock, waiting up to ``timeout_s`` for it (then ``BrokerUnavailable``)."""
        token = uuid.uuid4().hex
        deadline = time.monotonic() + self.timeout_s
        timeout_ms = int(self.timeout_s * 1000)
        async with self._local:
            await self._release_unreleased()
            pause = 0.001
            while True:
                async with translated_errors("taking the API lock"):
                    if await self.redis.set(self.key, token, nx=True, px=timeout_ms):
                        break
                if time.monotonic() > deadline:
                    raise BrokerUnavailable("the Atropos API lock stayed taken for "
                                            f"{self.timeout_s:.0f} s")
                await asyncio.sleep(pause)
                pause = min(0.05, pause * 2)
            try:
                yield
            finally:
                self._unreleased.add(token)
                with contextlib.suppress(redis_errors.RedisError, OSError):
                    await self._release(token)

    async def _release(self, token: str) -> None:
        await self.redis.eval(_RELEASE, 1, self.key, token)
        self._unreleased.discard(token)

    async def _release_unreleased(self) -> None:
        for token in list(self._unreleased):
            async with translated_errors("releasing the API lock"):
                await self._release(token)
