"""The feeder: admits rollout jobs at the pace the trainer can absorb.

Every ``poll_s`` it reads the trainer's policy version and the run's counters, asks
``admit`` how many jobs may start, and enqueues that many from the dataset cursor. The
cursor (``position``: epoch × dataset length + item index) and the ``admitted`` count live
in the run's state hash.

Any number of feeders may run (standbys for availability); they are safe because:

- **A lease serialises them.** A feeder admits only while it holds the run's feeder lease
  (``SET NX PX`` with a random token, released by a compare-and-delete script), so two
  feeders never read the same budget and both spend it. A feeder that dies holding it
  blocks the others for at most ``lease_s``.
- **Every step is idempotent, so even two holders at once stay correct** (a holder that
  stalls past its lease): a position is enqueued first, under its deterministic arq job id
  (arq refuses an id it already holds, so the job exists once whoever enqueued it), then
  one script commits it: only the first commit of a position (cursor still at or below it)
  counts it in ``admitted`` and moves the cursor past it. A feeder that dies between the
  enqueue and the commit leaves the cursor at that position: the next feeder's enqueue is
  refused (the job is there), and its commit counts the job once. No position is skipped,
  none is counted twice, and ``admitted`` equals the jobs in arq's queue.

Why enqueue-then-commit rather than claim-then-enqueue: a claim (cursor advanced first) that
dies before its enqueue skips positions unless a second record of "claimed, not enqueued"
is kept and swept; with deterministic job ids the enqueue is idempotent, so the cursor
itself is that record. The commit script only ever accepts the position at the cursor
(each feeder commits its positions in order, starting at or below the cursor), so the
cursor never jumps a position nobody enqueued.

A failing enqueue or commit (Redis away, or a write refused: OOM, READONLY during a
failover) raises ``BrokerUnavailable``; the loop logs it and tries again with back-off
(``OutageRider``) from the cursor, which has not moved past the failed position. A refusal
of the user (ACL ``NOPERM``, bad credentials) raises ``AccessRefused`` instead: a setting
to fix, which ends the feeder at once (exit 78) instead of being waited out.

Requeued jobs (``rollq dead requeue``) wait in the partitions' readmit lists; the budget
does not count them in flight, and each admission check spends it on them first, ahead of
new positions, so a requeue of hundreds of letters is paced like new work. The circuit
breaker (``schemas.breaker``): with ``trip_after``, a check first trips the run's breaker
when its failure streak calls for it, and admits nothing while it is open.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog

from rollq.producers.admission import admit, outstanding
from rollq.schemas import BrokerUnavailable, breaker
from rollq.schemas.breaker import Tripped
from rollq.schemas.errors import REFUSALS, access_refused, translated_errors
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    FEED_BATCH_GROUPS_FIELD,
    FEED_MAX_STALENESS_FIELD,
    PARTITIONS_FIELD,
    POLICY_VERSION_FIELD,
    counters_key,
    parse_job_id,
    readmit_key,
    run_key,
    state_key,
    sum_counters,
)
from rollq.schemas.outage import OutageRider, StoppedDuringOutage

log = structlog.get_logger("rollq.feeder")
CURSOR_FIELD = "cursor"

Enqueue = Callable[[int], Awaitable[bool]]
Requeue = Callable[[str, int], Awaitable[bool]]
"""Enqueue a requeued job again: ``(env, position) -> False`` when it is queued already."""

# KEYS[1] state hash; ARGV[1] a position whose job is in arq's queue now. The first commit
# of a position counts it and moves the cursor past it; any later one changes nothing.
_COMMIT = """
local cursor = tonumber(redis.call('HGET', KEYS[1], 'cursor') or '0')
local position = tonumber(ARGV[1])
if position < cursor then return 0 end
redis.call('HINCRBY', KEYS[1], 'admitted', 1)
redis.call('HSET', KEYS[1], 'cursor', position + 1)
return 1
"""
# KEYS[1] lease; ARGV[1] token. Deletes the lease only if this feeder still holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class FeedPlan:
    dataset_size: int
    epochs: int
    max_staleness: int
    batch_groups: int

    @property
    def total(self) -> int:
        return self.dataset_size * self.epochs

    @property
    def first_budget(self) -> int:
        """Jobs admitted before the trainer's first step: ``(max_staleness + 1) ×
        batch_groups``."""
        return (self.max_staleness + 1) * self.batch_groups


@dataclass(frozen=True)
class FeedState:
    cursor: int
    version: int
    consumed: int
    outstanding: int
    """Admitted and not consumed or dropped: in flight, buffered, or requeued and waiting
    in a readmit list."""
    admitted: int = 0
    """Groups admitted ever (the run state's ``admitted``)."""
    waiting: int = 0
    """Requeued jobs in the readmit lists, not yet enqueued again."""
    partitions: int = 1

    def free(self, plan: FeedPlan) -> int:
        """Jobs the admission rule allows now, requeued or new (a waiting job is not in
        flight yet)."""
        return admit(self.version, self.consumed, self.outstanding - self.waiting,
                     max_staleness=plan.max_staleness, batch_groups=plan.batch_groups)

    def budget(self, plan: FeedPlan) -> int:
        """New positions to admit now: what the rule allows after the requeued jobs."""
        return max(0, min(self.free(plan) - self.waiting, plan.total - self.cursor))


async def read_feed_state(redis: aioredis.Redis, run: str) -> FeedState:
    """The run's admission inputs: cursor, policy version, consumed, outstanding, admitted
    (what the feeder and the gateway's sessions both admit against: requeued jobs waiting
    for the feeder count as outstanding, so sessions leave their slots to them)."""
    state = await redis.hgetall(state_key(run))
    partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
    counters = sum_counters([await redis.hgetall(counters_key(run, p))
                             for p in range(partitions)])
    admitted = int(state.get(ADMITTED_FIELD.encode(), b"0"))
    consumed, pending = outstanding(admitted, counters)
    waiting = sum([int(await redis.llen(readmit_key(run, p))) for p in range(partitions)])
    return FeedState(
        cursor=int(state.get(CURSOR_FIELD.encode(), b"0")),
        version=int(state.get(POLICY_VERSION_FIELD.encode(), b"0")),
        consumed=consumed,
        outstanding=max(pending, waiting),
        admitted=admitted,
        waiting=waiting,
        partitions=partitions,
    )


async def record_plan(redis: aioredis.Redis, run: str, plan: FeedPlan) -> None:
    """Record the feeder's budget terms in the run's state, where a trainer reads them to
    name a ``batch_groups`` larger than the feeder's (``consumers.trainer.waiting``)."""
    async with translated_errors("recording the feeder's settings"):
        await redis.hset(state_key(run), mapping={FEED_BATCH_GROUPS_FIELD: plan.batch_groups,
                                                  FEED_MAX_STALENESS_FIELD: plan.max_staleness})


class Feeder:
    """Enqueues rollout jobs of one run while the admission budget allows."""

    def __init__(self, redis: aioredis.Redis, run: str, plan: FeedPlan, enqueue: Enqueue,
                 *, lease_s: float = 30.0, trip_after: int | None = None,
                 requeue: Requeue | None = None) -> None:
        self.redis = redis
        self.run = run
        self.plan = plan
        self.enqueue = enqueue
        self.requeue = requeue
        self.lease_s = lease_s
        self.lease_key = run_key(run, "feeder:lease")
        self._token = secrets.token_hex(8)
        self._commit = redis.register_script(_COMMIT)
        self._release = redis.register_script(_RELEASE)
        self.admitted = 0
        """Jobs this feeder admitted (committed first), for its metrics."""
        self.readmitted = 0
        """Requeued jobs this feeder enqueued again from the readmit lists."""
        self.last_state: FeedState | None = None
        self.last_budget = 0
        """The state and budget of this feeder's last admission check (its metrics)."""
        self.trip_after = None if not trip_after else min(trip_after, plan.first_budget)
        """Consecutive same-reason job failures that stop admission (``schemas.breaker``),
        at most the first budget so that at most twice the budget is dead-lettered; None:
        never stop."""
        self.partitions = 1
        """The run's partition count, as the last ``read_state`` found it."""
        self.tripped: Tripped | None = None
        """The open breaker this feeder last saw (None: admitting)."""

    @property
    def key(self) -> str:
        return state_key(self.run)

    async def read_state(self) -> FeedState:
        state = await read_feed_state(self.redis, self.run)
        self.partitions = state.partitions
        return state

    async def feed_once(self) -> int:
        """Admit as many jobs as the budget allows now, if this feeder gets the lease;
        returns how many it admitted."""
        try:
            return await self._feed_once()
        except REFUSALS as exc:  # an ACL refusal or bad credentials: a setting, not an outage
            user = self.redis.connection_pool.connection_kwargs.get("username")
            raise access_refused(exc, user=user) from exc
        except (redis_errors.RedisError, OSError) as exc:  # refused writes too: OOM, READONLY
            raise BrokerUnavailable(f"redis unavailable while admitting jobs: "
                                    f"{type(exc).__name__}: {exc}") from exc

    async def _feed_once(self) -> int:
        if not await self.redis.set(self.lease_key, self._token, nx=True,
                                    px=int(self.lease_s * 1000)):
            return 0  # another feeder admits now: this one is a standby
        try:
            if await self._breaker_open():
                return 0
            state = self.last_state = await self.read_state()
            readmitted = await self._readmit(min(state.waiting, state.free(self.plan)))
            budget = self.last_budget = state.budget(self.plan)
            created = 0
            for position in range(state.cursor, state.cursor + budget):
                fresh = await self.enqueue(position)
                committed = int(await self._commit(keys=[self.key], args=[position]))
                created += committed
                self.admitted += committed
                if not fresh:
                    log.info("job_already_enqueued", position=position)
        finally:
            await self._release(keys=[self.lease_key], args=[self._token])
        if readmitted:
            log.info("requeued_jobs_admitted", count=readmitted, waiting=state.waiting
                     - readmitted, policy_version=state.version)
        if budget:
            log.info("jobs_admitted", count=created, cursor=state.cursor + budget,
                     policy_version=state.version, consumed=state.consumed,
                     outstanding=state.outstanding)
        return created

    async def _readmit(self, count: int) -> int:
        """Enqueue up to ``count`` requeued jobs from the readmit lists, oldest first per
        partition. Each is enqueued before it leaves its list, so a feeder that dies in
        between enqueues it again (refused while queued; a job that already ran runs again
        and the trainer drops the copy: a duplicate, never a loss)."""
        done = 0
        for partition in range(self.partitions):
            key = readmit_key(self.run, partition)
            while done < count:
                raw = await self.redis.lindex(key, 0)
                if raw is None:
                    break
                ident = raw.decode()
                parsed = parse_job_id(self.run, ident)
                if parsed is None or self.requeue is None:
                    log.error("requeued_job_refused", job=ident, reason="not a rollout job "
                              "of this run" if parsed is None else "no requeue on this feeder")
                    if parsed is None:  # unreadable: it cannot ever be admitted
                        await self.redis.lrem(key, 1, raw)
                        continue
                    return done
                await self.requeue(*parsed)
                await self.redis.lrem(key, 1, raw)
                done += 1
                self.readmitted += 1
        return done

    async def _breaker_open(self) -> bool:
        """Trip the breaker when the failure streak calls for it; log ONE error line per
        trip (and one line when a resume closed it)."""
        tripped = (await breaker.read(self.redis, self.run) if self.trip_after is None
                   else await breaker.trip(self.redis, self.run, self.trip_after))
        if tripped is None:
            if self.tripped is not None:
                log.info("admission_resumed", run=self.run)
            self.tripped = None
            return False
        if self.tripped is None or self.tripped.at != tripped.at:
            log.error("admission_stopped", run=self.run, reason=tripped.reason,
                      streak=tripped.streak, detail=tripped.detail[:300],
                      resume=breaker.RESUME_COMMAND.format(run=self.run),
                      message=tripped.explain(self.run))
        self.tripped = tripped
        return True

    async def finished(self) -> bool:
        """Whether every epoch is admitted and no requeued job waits."""
        async with translated_errors("reading the cursor"):
            cursor = await self.redis.hget(self.key, CURSOR_FIELD)
            waiting = sum([int(await self.redis.llen(readmit_key(self.run, p)))
                           for p in range(self.partitions)])
        return int(cursor or 0) >= self.plan.total and not waiting

    async def run_until(self, stop: asyncio.Event, poll_s: float,
                        rider: OutageRider | None = None) -> None:
        """Feed until the dataset's epochs are all admitted or ``stop`` is set; Redis
        outages are ridden out by ``rider`` (default: fail at once), which ends them early
        when it was given ``stop``."""
        rider = rider or OutageRider(give_up_s=0.0, what="feeder", log=log)
        while not stop.is_set():
            try:
                await rider.call(self.feed_once)
                if await rider.call(self.finished):
                    log.info("feeder_finished", total=self.plan.total)
                    return
            except StoppedDuringOutage:
                return  # the cursor has not moved past what was not committed
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass
        state = self.last_state
        log.info("feeder_stopped", admitted=self.admitted, readmitted=self.readmitted,
                 cursor=None if state is None else state.cursor + self.last_budget,
                 total=self.plan.total)
