"""Items drawn from a stateful source, recorded per job so that a re-run rolls the same one.

Most envs address items by index (``Env.item``), so a re-run of a job finds its item again
by its position. An env that draws its items from a stateful source instead (Atropos'
``get_next_item``: a cursor, a shuffled stream, a backlog) implements ``DrawingEnv``: the
rollout runner calls ``ItemLedger.item``, which draws once per job and records the drawn
item under the job's group id (``SET NX``, so two tries racing agree on one) before the
rollout starts. A later try of the job (a crash, a retry, ``rollq dead requeue``) reads
the record instead of drawing again. The record is removed once the group is published;
one left behind (a crash between publish and removal, a dead letter never requeued)
expires after ``RECORD_TTL_S``.

Key: ``rollq:{<run>}:drawn:<group_id>``, a JSON object (the item's fields).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from rollq.schemas import ContractError
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import run_key

RECORD_TTL_S = 30 * 24 * 3600
"""A record outlives a queued job (``producers.worker.JOB_EXPIRY_S``) and a dead letter's
retention, so any try or requeue of the job still finds its item."""

Draw = Callable[[], Awaitable[dict[str, Any]]]


class ItemLedger:
    """Records of drawn items of one run (module docstring)."""

    def __init__(self, redis: aioredis.Redis, run: str) -> None:
        self.redis = redis
        self.run = run

    def key(self, group_id: str) -> str:
        return run_key(self.run, f"drawn:{group_id}")

    async def item(self, group_id: str, draw: Draw) -> tuple[dict[str, Any], bool]:
        """The item of job ``group_id``: recorded earlier, else drawn now and recorded.
        Returns the item's fields as stored (decoded from the record, so the first try and
        every re-run see equal values) and whether it was drawn by this call."""
        key = self.key(group_id)
        async with translated_errors("recording a drawn item"):
            stored = await self.redis.get(key)
            drawn = False
            if stored is None:
                fields = await draw()
                try:
                    payload = orjson.dumps(fields)
                except TypeError as exc:
                    raise ContractError(f"a drawn item is not JSON-serialisable: {exc}") from exc
                drawn = bool(await self.redis.set(key, payload, nx=True, ex=RECORD_TTL_S))
                stored = payload if drawn else await self.redis.get(key)
                if stored is None:  # removed between the two calls: keep ours
                    await self.redis.set(key, payload, ex=RECORD_TTL_S)
                    stored, drawn = payload, True
        value = orjson.loads(stored)
        if not isinstance(value, dict):
            raise ContractError(f"the drawn-item record of {group_id!r} is not an object")
        return value, drawn

    async def forget(self, group_id: str) -> None:
        """Remove the record once the job's group is published (a failure here is
        harmless: the record expires)."""
        try:
            await self.redis.delete(self.key(group_id))
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
            pass
