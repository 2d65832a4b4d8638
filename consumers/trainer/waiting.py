"""What a trainer says while ``next_batch`` waits for data.

A trainer that waits in silence looks like a hang: a stopped feeder, a run name with a typo,
every group dropped as zero-variance, an admission budget smaller than the trainer's batch.
So while one ``next_batch`` call waits longer than ``wait_log_s``, ``WaitReporter`` logs
``trainer_waiting`` (INFO) every ``wait_log_s`` with what it holds and wants, and records in
the run's state hash how many groups the trainer waits for (``TRAINER_WAITING_FIELD``), so
the feeder can name a ``--batch-groups`` mismatch (``ops.watchdog``). The field is removed
when the batch is handed out. An open circuit breaker (``schemas.breaker``) is logged once,
at ERROR: the trainer waits in vain until the run is resumed.

A trainer whose step takes more groups than the run's feeder admits per step (the feeder
records its ``batch_groups`` and ``max_staleness`` in the run's state) waits forever after a
few steps: ``check_admission`` says so at WARNING when the client starts and again at every
``trainer_waiting`` line (``batch_groups_exceed_admission``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import stream_stats
from rollq.schemas import BrokerUnavailable, breaker
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import (
    FEED_BATCH_GROUPS_FIELD,
    FEED_MAX_STALENESS_FIELD,
    TRAINER_WAITING_FIELD,
    state_key,
    stream_keys,
)
from rollq.schemas.outage import OutageRider
from rollq.schemas.tasks import beside

log = structlog.get_logger("rollq.trainer")



class WaitReporter:
    """Logs one trainer's long waits; one instance per ``TrainerClient``."""

    def __init__(self, redis: aioredis.Redis, run: str, every_s: float) -> None:
        self.redis = redis
        self.run = run
        self.every_s = every_s
        self._breaker = breaker.Notice(run, "trainer", log)
        self._marked = False  # the state hash says this trainer waits

    @contextlib.asynccontextmanager
    async def waiting(self, wanted: int | None, held: Callable[[], int]) -> AsyncIterator[None]:
        """Report while the block runs longer than ``every_s``; ``wanted``: the batch's group
        count (None: sized by sequences or tokens), ``held``: groups queued for it now."""
        try:
            async with beside(self._report(wanted, held), name="rollq-trainer-waiting"):
                yield
        finally:
            if self._marked:
                await self._recorded(None)

    async def _report(self, wanted: int | None, held: Callable[[], int]) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(self.every_s)
            log.info("trainer_waiting", run=self.run, waited_s=round(time.monotonic() - started),
                     groups_wanted=wanted, groups_held=held())
            if wanted is not None:
                await self._recorded(wanted)
            await self._check_breaker()
            await self.check_admission(wanted)

    async def check_admission(self, wanted: int | None) -> None:
        """Warn when steps of ``wanted`` groups outrun what the run's feeder admits (module
        docstring); nothing when the feeder has not recorded its settings, or Redis is away."""
        if wanted is None:
            return
        try:
            async with translated_errors("reading the feeder's settings"):
                batch, staleness = await self.redis.hmget(
                    state_key(self.run), [FEED_BATCH_GROUPS_FIELD, FEED_MAX_STALENESS_FIELD])
        except BrokerUnavailable:
            return
        if batch is None or staleness is None or wanted <= int(batch):
            return
        step = stalled_step(wanted, int(batch), int(staleness))
        log.warning("batch_groups_exceed_admission", run=self.run, trainer_batch_groups=wanted,
                    feed_batch_groups=int(batch), feed_max_staleness=int(staleness),
                    stalls_at_step=step, message=(
                        f"this trainer takes {wanted} groups a step but the run's feeder "
                        f"admits {int(batch)} a step: at most (max_staleness {int(staleness)} "
                        f"+ policy_version + 1) × batch_groups {int(batch)} groups ever, so "
                        f"step {step} waits forever (a deadlock); run `rollq feed` with "
                        f"--batch-groups {wanted}, or this trainer with --batch-groups "
                        f"{int(batch)}"))

    async def _recorded(self, wanted: int | None) -> None:
        """Record (or, with None, clear) the groups this trainer waits for; best effort: a
        Redis outage is the outage rider's to report, not this log's."""
        try:
            async with translated_errors("recording the trainer's wait"):
                if wanted is None:
                    await self.redis.hdel(state_key(self.run), TRAINER_WAITING_FIELD)
                else:
                    await self.redis.hset(state_key(self.run), TRAINER_WAITING_FIELD,
                                          str(wanted))
            self._marked = wanted is not None
        except BrokerUnavailable as exc:
            log.debug("trainer_wait_not_recorded", run=self.run, error=str(exc))

    async def _check_breaker(self) -> None:
        with contextlib.suppress(BrokerUnavailable):
            await self._breaker.check(self.redis)


def stalled_step(wanted: int, batch_groups: int, max_staleness: int) -> int:
    """The first step a trainer taking ``wanted`` groups a step never gets, under a feeder
    admitting ``(max_staleness + version + 1) × batch_groups`` in all (``wanted`` above
    ``batch_groups``): step ``v + 1`` needs ``(v + 1) × wanted`` groups admitted."""
    version = 0
    while (max_staleness + version + 1) * batch_groups >= (version + 1) * wanted:
        version += 1
    return version + 1


async def stall_reason(redis: aioredis.Redis, run: str, partitions: int, version: int,
                       rider: OutageRider, give_up_s: float) -> str:
    """Why no scored group may be arriving, in one line, from what Redis says now: an
    outage the trainer rides out, an open circuit breaker (admission stopped), trajectories
    waiting for a scorer, or none generated (the feeder stopped, or admission is spent)."""
    if rider.down_since is not None:
        return (f"Redis unreachable for {time.monotonic() - rider.down_since:.0f} s (run "
                f"{run!r}); the trainer rides it out for {give_up_s:.0f} s")
    tripped = await breaker.read(redis, run)
    if tripped is not None:
        return tripped.explain(run)
    backlog = 0  # trajectories no scorer finished: not yet read, or read and pending
    for key in stream_keys(run, partitions or 1, "traj"):
        stats = await stream_stats(redis, key)
        for group in stats.groups if stats else []:
            backlog += group.pending + (group.lag or 0)
        if stats and not stats.groups:
            backlog += stats.length
    if backlog:
        return (f"no scored group of run {run!r}: {backlog} trajectories wait for a scorer "
                f"(are the scorers running?)")
    return (f"nothing generated for run {run!r} at policy version {version}: is the feeder "
            f"running, and does its admission (max_staleness, batch_groups) leave room?")
