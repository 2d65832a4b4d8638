"""``rollq status``: what a run's streams hold, who reads them, and what was dropped why."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from consumers.bus import StreamStats, stream_stats, translated_errors
from schemas import DecodeError, scored_rewards
from schemas.keys import (
    ADMITTED_FIELD,
    DROP_PREFIX,
    PARTITIONS_FIELD,
    POLICY_VERSION_FIELD,
    RUNS_KEY,
    STREAM_NAMES,
    counters_key,
    state_key,
    stream_key,
)


class RunNotFound(LookupError):
    """The run has no state in this Redis."""


@dataclass
class RunStatus:
    run: str
    partitions: int
    policy_version: int
    admitted: int
    counters: dict[str, int]
    """Summed over partitions: scored, consumed and drop:<reason>."""
    streams: list[StreamStats]
    reward_mean: float | None = None
    reward_samples: int = 0
    taken_at: float = field(default_factory=time.time)

    @property
    def drops(self) -> dict[str, int]:
        return {k[len(DROP_PREFIX):]: v for k, v in sorted(self.counters.items())
                if k.startswith(DROP_PREFIX)}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drops": self.drops}


async def known_runs(redis: aioredis.Redis) -> list[str]:
    async with translated_errors("listing runs"):
        return sorted(r.decode() for r in await redis.smembers(RUNS_KEY))


async def collect_status(redis: aioredis.Redis, run: str, reward_window: int = 64) -> RunStatus:
    """Gather a run's status; raises ``RunNotFound`` when the run does not exist."""
    async with translated_errors("reading run state"):
        state = await redis.hgetall(state_key(run))
    if not state:
        raise RunNotFound(run)
    partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
    counters: dict[str, int] = {}
    streams: list[StreamStats] = []
    rewards: list[float] = []
    for p in range(partitions):
        async with translated_errors("reading counters"):
            for name, value in (await redis.hgetall(counters_key(run, p))).items():
                counters[name.decode()] = counters.get(name.decode(), 0) + int(value)
        for name in STREAM_NAMES:
            stats = await stream_stats(redis, stream_key(run, p, name))
            if stats is not None:
                streams.append(stats)
        async with translated_errors("reading recent rewards"):
            recent = await redis.xrevrange(stream_key(run, p, "scored"),
                                           count=max(1, reward_window // partitions))
        for _, fields in recent:
            try:
                rewards += scored_rewards(fields)
            except DecodeError:
                continue
    return RunStatus(
        run=run,
        partitions=partitions,
        policy_version=int(state.get(POLICY_VERSION_FIELD.encode(), b"0")),
        admitted=int(state.get(ADMITTED_FIELD.encode(), b"0")),
        counters=counters,
        streams=streams,
        reward_mean=float(np.mean(rewards)) if rewards else None,
        reward_samples=len(rewards),
    )


def render_status(status: RunStatus, previous: RunStatus | None = None) -> str:
    """Human-readable status; with ``previous``, counters also show rates per second."""
    lines = [
        f"run {status.run}: {status.partitions} partition(s), policy_version "
        f"{status.policy_version}, admitted {status.admitted}, "
        f"scored {status.counters.get('scored', 0)}, consumed {status.counters.get('consumed', 0)}"
    ]
    if previous is not None:
        elapsed = max(status.taken_at - previous.taken_at, 1e-9)
        rate = {k: (status.counters.get(k, 0) - previous.counters.get(k, 0)) / elapsed
                for k in ("scored", "consumed")}
        lines.append(f"rates: scored {rate['scored']:.1f}/s, consumed {rate['consumed']:.1f}/s")
    if status.reward_mean is not None:
        lines.append(f"reward: mean {status.reward_mean:.3f} over the last "
                     f"{status.reward_samples} scored completions")
    lines.append(f"{'stream':<32} {'length':>8}  {'group':<12} {'consumers':>9} {'pending':>8} "
                 f"{'lag':>6} {'oldest pending':>15}")
    for stream in status.streams:
        if not stream.groups:
            lines.append(f"{stream.key:<32} {stream.length:>8}  {'-':<12}")
        for i, group in enumerate(stream.groups):
            key, length = (stream.key, str(stream.length)) if i == 0 else ("", "")
            oldest = group.oldest_pending_idle_s
            idle = "-" if oldest is None else f"{oldest:.1f}s"
            lag = "?" if group.lag is None else str(group.lag)
            lines.append(f"{key:<32} {length:>8}  {group.name:<12} {group.consumers:>9} "
                         f"{group.pending:>8} {lag:>6} {idle:>15}")
    drops = status.drops
    lines.append("drops by reason: " + (", ".join(f"{k} {v}" for k, v in drops.items())
                                        if drops else "none"))
    return "\n".join(lines)
