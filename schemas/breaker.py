"""The run-level circuit breaker: stop admitting jobs that can only fail.

A misconfiguration (a ``--model`` the server does not serve, a wrong inference port) makes
every rollout job fail the same way. Each failure frees its admission slot, so without a
breaker the feeder admits the next job at once and burns the dataset into dead letters.

The workers keep a *failure streak* in the run's state hash: a job dead-lettered for one of
``STREAK_REASONS`` extends the streak when the reason is the streak's, or starts a new one;
a published group (or a dead letter for any other reason) ends it. The feeder *trips* the
breaker when the streak reaches its threshold: it records the reason, the last detail and
the time in the state hash and admits nothing until someone *resumes* the run
(``rollq runs resume RUN``), which clears the breaker and the streak. The threshold is at
most the admission budget, so at most the streak plus the jobs in flight at the trip — no
more than twice the budget — end as dead letters.

A reward with no signal trips the same breaker: the scorers keep a *zero-variance streak*
(groups dropped as ``zero_variance`` since the last forwarded group) and, when it reaches
their ``zero_variance_breaker`` setting, trip it themselves with reason ``zero_variance``
(``record_zero_variance``): every completion of each group got the same reward, so GRPO
learns nothing and the run would spend its dataset for nothing.

Everything is one Lua call per verb on the state hash (one key: any Redis, Cluster too).
It lives in the leaf package because the workers write it, the feeder trips it, and every
role (the trainer SDK included) reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from rollq.schemas.errors import translated_errors
from rollq.schemas.failures import (
    CONTRACT_ERROR,
    ENV_UNAVAILABLE,
    INFERENCE_UNAVAILABLE,
    JOB_TIMEOUT,
)
from rollq.schemas.keys import state_key

STREAK_REASONS = frozenset({CONTRACT_ERROR, INFERENCE_UNAVAILABLE, JOB_TIMEOUT, ENV_UNAVAILABLE})
"""Dead-letter reasons that point at the run's configuration (the model, the servers, an
env server), not at one item: only these build a streak."""
STREAK_FIELD = "failure_streak"
STREAK_REASON_FIELD = "failure_streak_reason"
STREAK_DETAIL_FIELD = "failure_streak_detail"
TRIPPED_FIELD = "breaker_tripped_at"
TRIPPED_REASON_FIELD = "breaker_reason"
TRIPPED_DETAIL_FIELD = "breaker_detail"
TRIPPED_STREAK_FIELD = "breaker_streak"
ZERO_VARIANCE_STREAK_FIELD = "zero_variance_streak"
ZERO_VARIANCE = "zero_variance"
"""The drop reason of a group whose completions all got the same reward; as a breaker
reason: the last ``streak`` scored groups were all dropped so."""

# KEYS[1] state; ARGV[1] reason, ARGV[2] detail, ARGV[3] 1 when the reason builds a streak.
_FAILED = """
if ARGV[3] ~= '1' then
  redis.call('HSET', KEYS[1], 'failure_streak', 0)
  return 0
end
if redis.call('HGET', KEYS[1], 'failure_streak_reason') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'failure_streak_detail', ARGV[2])
  return redis.call('HINCRBY', KEYS[1], 'failure_streak', 1)
end
redis.call('HSET', KEYS[1], 'failure_streak', 1, 'failure_streak_reason', ARGV[1],
           'failure_streak_detail', ARGV[2])
return 1
"""
# KEYS[1] state. A success ends the streak; one HGET when there is none (the common case).
_SUCCEEDED = """
local streak = redis.call('HGET', KEYS[1], 'failure_streak')
if streak and streak ~= '0' then redis.call('HSET', KEYS[1], 'failure_streak', 0) end
return 0
"""
# KEYS[1] state; ARGV[1] threshold, ARGV[2] now. Returns 1 when the breaker is (now) open.
_TRIP = """
if redis.call('HEXISTS', KEYS[1], 'breaker_tripped_at') == 1 then return 1 end
local streak = tonumber(redis.call('HGET', KEYS[1], 'failure_streak') or '0')
if streak < tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'breaker_tripped_at', ARGV[2],
           'breaker_reason', redis.call('HGET', KEYS[1], 'failure_streak_reason'),
           'breaker_detail', redis.call('HGET', KEYS[1], 'failure_streak_detail') or '',
           'breaker_streak', streak)
return 1
"""
# KEYS[1] state; ARGV[1] '1' when the read forwarded a group (the streak restarts), ARGV[2]
# zero-variance drops since the read's last forward (or in the whole read), ARGV[3] threshold
# (0: never trip), ARGV[4] now, ARGV[5] detail. Returns 1 when this call opened the breaker.
_ZERO_VARIANCE = """
local streak
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'zero_variance_streak', ARGV[2])
  streak = tonumber(ARGV[2])
else
  streak = redis.call('HINCRBY', KEYS[1], 'zero_variance_streak', ARGV[2])
end
local threshold = tonumber(ARGV[3])
if threshold == 0 or streak < threshold then return 0 end
if redis.call('HEXISTS', KEYS[1], 'breaker_tripped_at') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'breaker_tripped_at', ARGV[4], 'breaker_reason', 'zero_variance',
           'breaker_detail', ARGV[5], 'breaker_streak', streak)
return 1
"""
RESUME_COMMAND = "rollq runs resume {run}"
"""What a user runs to admit jobs again once the cause is fixed (``{run}``: the run)."""


@dataclass(frozen=True)
class Tripped:
    """An open breaker: why the feeder stopped admitting."""

    reason: str
    """The dead-letter reason every job of the streak ended with."""
    detail: str
    """The last of those jobs' detail (e.g. the server's answer)."""
    streak: int
    """Consecutive jobs that failed so when it tripped."""
    at: float
    """When it tripped, in Unix seconds."""

    def explain(self, run: str) -> str:
        """One line: why admission stopped, and how to resume."""
        if self.reason == ZERO_VARIANCE:
            return (f"admission stopped: the last {self.streak} groups scored in run {run!r} "
                    "were all dropped as zero-variance: every completion of a group got the "
                    "same reward, so GRPO has nothing to learn from and the run would spend "
                    "its dataset for nothing; use a reward with partial credit (a score "
                    "between 0 and 1), a larger --group-size or a higher temperature, easier "
                    "or harder items, or zero_variance: keep; then run "
                    f"`{RESUME_COMMAND.format(run=run)}`")
        return (f"admission stopped: the last {self.streak} rollout jobs of run {run!r} all "
                f"failed with {self.reason} ({self.detail[:300]}); fix the cause, then run "
                f"`{RESUME_COMMAND.format(run=run)}`")


async def record_failure(redis: aioredis.Redis, run: str, reason: str, detail: str) -> int:
    """Count a dead-lettered rollout job; returns the streak it is part of (0: none)."""
    async with translated_errors("recording a failure streak"):
        return int(await redis.eval(_FAILED, 1, state_key(run), reason, detail[:2000],
                                    "1" if reason in STREAK_REASONS else "0"))


async def record_success(redis: aioredis.Redis, run: str) -> None:
    """A published group ends any failure streak."""
    async with translated_errors("ending a failure streak"):
        await redis.eval(_SUCCEEDED, 1, state_key(run))


async def record_zero_variance(redis: aioredis.Redis, run: str, *, forwarded: bool,
                               dropped: int, threshold: int) -> Tripped | None:
    """Count a scored read's zero-variance drops (``forwarded``: the read forwarded a group,
    ``dropped``: its zero-variance drops after the last forward, or all of them); the breaker
    this call opened when the streak reached ``threshold`` (0: never), else None."""
    async with translated_errors("recording a zero-variance streak"):
        opened = await redis.eval(_ZERO_VARIANCE, 1, state_key(run), "1" if forwarded else "0",
                                  str(dropped), str(threshold), repr(time.time()),
                                  "every completion of each group got the same reward")
    return await read(redis, run) if opened else None


async def trip(redis: aioredis.Redis, run: str, threshold: int) -> Tripped | None:
    """Open the breaker when the streak reached ``threshold``; the open breaker (tripped now
    or before) or None."""
    async with translated_errors("checking the circuit breaker"):
        opened = await redis.eval(_TRIP, 1, state_key(run), str(threshold), repr(time.time()))
    return await read(redis, run) if opened else None


async def read(redis: aioredis.Redis, run: str) -> Tripped | None:
    """The open breaker of ``run``, or None."""
    async with translated_errors("reading the circuit breaker"):
        values = await redis.hmget(state_key(run), [TRIPPED_FIELD, TRIPPED_REASON_FIELD,
                                                    TRIPPED_DETAIL_FIELD, TRIPPED_STREAK_FIELD])
    at, reason, detail, streak = values
    if at is None:
        return None
    return Tripped(reason=(reason or b"").decode(), detail=(detail or b"").decode(),
                   streak=int(streak or 0), at=float(at))


async def resume(redis: aioredis.Redis, run: str) -> Tripped | None:
    """Close the breaker and forget the streak; returns the breaker that was open."""
    was = await read(redis, run)
    async with translated_errors("resuming the run"):
        pipe = redis.pipeline(transaction=True)
        pipe.hdel(state_key(run), TRIPPED_FIELD, TRIPPED_REASON_FIELD, TRIPPED_DETAIL_FIELD,
                  TRIPPED_STREAK_FIELD)
        pipe.hset(state_key(run), mapping={STREAK_FIELD: "0", ZERO_VARIANCE_STREAK_FIELD: "0"})
        await pipe.execute()
    return was


class Notice:
    """Logs an open breaker ONE time per trip, at ERROR, for a role that did not trip it
    (workers, scorers, trainers: the feeder logs its own trip)."""

    def __init__(self, run: str, role: str, log: Any) -> None:
        self.run = run
        self.role = role
        self.log = log
        self._seen: float | None = None

    async def check(self, redis: aioredis.Redis) -> Tripped | None:
        """Read the breaker; log it when it tripped since the last check."""
        return self.seen(await read(redis, self.run))

    def seen(self, tripped: Tripped | None) -> Tripped | None:
        """Log ``tripped`` (the breaker as just read) unless this notice logged it already."""
        if tripped is not None and tripped.at != self._seen:
            self.log.error("admission_stopped", run=self.run, role=self.role,
                           reason=tripped.reason, streak=tripped.streak,
                           message=tripped.explain(self.run))
        self._seen = None if tripped is None else tripped.at
        return tripped
