"""What both halves of the ``rollq dead`` tests (``test_dead.py`` and
``test_dead_requeue.py``) share: the run, a reward config the groups fail, a pass of the real
scorer stage, the run's counters and a letter written as the bus writes one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from rollq.ops.roles import run_scorer
from rollq.ops.settings import ScorerSettings
from rollq.schemas import DeadLetter, Fields, encode_dead
from rollq.schemas.keys import counters_key, stream_key

RUN = "deadrun"
NEEDS_GOLD = ("components:\n  - name: accuracy\n    component: accuracy\n"
              "    settings: {kind: gsm8k}\nadvantages: {zero_variance: keep}\n")


async def scorer_pass(url: str, config: Path) -> None:
    """The real scorer stage (ops.roles.run_scorer) over whatever the traj stream holds."""
    await run_scorer(ScorerSettings(redis_url=url, run=RUN, reward_config=config,
                                    processes=1), asyncio.Event(), burst=True)


async def counters(redis: aioredis.Redis, partition: int = 0) -> dict[str, int]:
    raw = await redis.hgetall(counters_key(RUN, partition))
    return {k.decode(): int(v) for k, v in raw.items()}


async def put_letter(redis: aioredis.Redis, *, partition: int = 0, at_ms: int,
                     reason: str = "reward_error", source: str = "traj",
                     source_id: str = "1-0", payload: Fields | None = None,
                     group_id: str = "g") -> str:
    """A letter written as the bus writes one (XADD + drop:<reason>), at a chosen time."""
    letter = DeadLetter(
        reason=reason, detail=f"{reason} of {group_id}\nsecond line",
        source_stream=stream_key(RUN, partition, source), source_id=source_id,  # type: ignore[arg-type]
        consumer_group="scorers", deliveries=1, dead_at=at_ms / 1000,
        payload=payload if payload is not None else {b"group_id": group_id.encode()})
    entry_id = f"{at_ms}-0"
    await redis.xadd(stream_key(RUN, partition, "dead"), encode_dead(letter),  # type: ignore[arg-type]
                     id=entry_id)
    await redis.hincrby(counters_key(RUN, partition), "drop:" + reason, 1)
    return entry_id
