"""No silent stall: a long-running role says why its run makes no progress.

Every feeder, worker pool and scorer runs a ``RunWatchdog`` beside its work. Every
``check_s`` it reads the run's state and counters (a few HGETs and XLENs). Progress is a
group scored or consumed; when neither happened for ``stall_warning_s``, the watchdog logs
ONE WARNING naming the first cause that fits, and nothing more until the run moves again:

- ``run_not_found_at_start`` is said at start-up instead (``warn_if_unknown``, at once:
  a typo in ``--run``, the line names the known runs); a run still untouched when the stall
  time is up adds no second line;
- ``groups_all_zero_variance``: every group scored meanwhile was dropped as zero-variance
  (with the count and the run's share): the reward gives GRPO no signal;
- ``admission_budget_exhausted`` (the feeder, which knows the budget): the budget is 0 and
  the trainer consumes nothing; when the trainer waits for more groups than can ever be
  outstanding (feed ``--batch-groups`` below the trainer's), it says so: a deadlock;
- ``run_stalled``: anything else, with the numbers (admitted, queued streams, drops);
- ``run_idle`` (INFO, not a warning): nothing is in flight, every admitted group was
  consumed or dropped: the run has finished its epochs (or its feeder is not running).

An open circuit breaker (``schemas.breaker``) is logged once per trip at ERROR by every role
except the feeder, which logs its own trip. A Redis outage is the role's outage rider's to
report: a check that cannot reach Redis is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from rollq.producers.admission import outstanding
from rollq.producers.feeder import Feeder
from rollq.schemas import BrokerUnavailable, breaker
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    CONSUMED_COUNTER,
    DROP_PREFIX,
    PARTITIONS_FIELD,
    SCORED_COUNTER,
    TRAINER_WAITING_FIELD,
    counters_key,
    state_key,
    stream_key,
    sum_counters,
)
from rollq.schemas.runs import known_runs, run_started, unknown_run_message
from rollq.schemas.tasks import beside

log = structlog.get_logger("rollq.watchdog")
ZERO_VARIANCE = DROP_PREFIX + "zero_variance"


@dataclass(frozen=True)
class Reading:
    """What the watchdog reads of a run at one check."""

    admitted: int
    scored: int
    consumed: int
    zero_variance: int
    drops: dict[str, int]
    unscored: int
    """Entries of the traj streams (scored or not: XLEN, no group lookups)."""
    unconsumed: int
    """Entries of the scored streams."""
    trainer_waiting: int | None
    """Groups the trainer has been waiting for (None: it does not wait, or is not there)."""
    in_flight: int
    """Admitted groups not yet consumed or dropped (``producers.admission.outstanding``)."""

    @property
    def progress(self) -> int:
        return self.scored + self.consumed

    @property
    def untouched(self) -> bool:
        """Nothing ever happened in the run."""
        return not (self.admitted or self.scored or self.consumed or self.drops
                    or self.unscored or self.unconsumed)


class RunWatchdog:
    """Says, once per stall, why a run makes no progress (module docstring).

    ``existed``: whether the run was known before this role registered it (read it with
    ``known_runs`` before the role starts); ``feeder``: the feeder of this process, whose
    plan and budget explain an exhausted admission.
    """

    def __init__(self, redis: aioredis.Redis, run: str, role: str, *, stall_s: float,
                 existed: bool = True, feeder: Feeder | None = None,
                 check_s: float | None = None, notice: breaker.Notice | None = None) -> None:
        self.redis = redis
        self.run = run
        self.role = role
        self.stall_s = stall_s
        self.existed = existed
        self.feeder = feeder
        self.check_s = check_s if check_s is not None else min(5.0, stall_s / 4)
        self.warned: str | None = None
        """The stall warning logged since the last progress (None: none)."""
        self._last: Reading | None = None  # at the last progress
        self._since = time.monotonic()
        self._breaker = notice or breaker.Notice(run, role, log)

    async def read(self) -> Reading:
        async with translated_errors("watching the run"):
            state = {k.decode(): v.decode() for k, v in
                     (await self.redis.hgetall(state_key(self.run))).items()}
            partitions = int(state.get(PARTITIONS_FIELD, "1"))
            counters = sum_counters([await self.redis.hgetall(counters_key(self.run, p))
                                     for p in range(partitions)])
            lengths = {name: sum([int(await self.redis.xlen(stream_key(self.run, p, name)))
                                  for p in range(partitions)])
                       for name in ("traj", "scored")}
        waiting = state.get(TRAINER_WAITING_FIELD)
        return Reading(
            admitted=int(state.get(ADMITTED_FIELD, "0")),
            scored=counters.get(SCORED_COUNTER, 0), consumed=counters.get(CONSUMED_COUNTER, 0),
            zero_variance=counters.get(ZERO_VARIANCE, 0),
            drops={k[len(DROP_PREFIX):]: v for k, v in counters.items()
                   if k.startswith(DROP_PREFIX) and v},
            unscored=lengths["traj"], unconsumed=lengths["scored"],
            trainer_waiting=int(waiting) if waiting is not None else None,
            in_flight=outstanding(int(state.get(ADMITTED_FIELD, "0")), counters)[1])

    async def check(self) -> None:
        """One look at the run: log the breaker or a stall cause when due."""
        if self.feeder is None:
            await self._breaker.check(self.redis)
        reading = await self.read()
        now = time.monotonic()
        if self._last is None or reading.progress != self._last.progress:
            self._last, self._since, self.warned = reading, now, None
            return
        if self.warned is not None or now - self._since < self.stall_s:
            return
        if self.feeder is not None and self.feeder.tripped is not None:
            return  # the feeder said why at ERROR
        self.warned = await self._warn(reading, self._last, now - self._since)

    async def _warn(self, reading: Reading, before: Reading, stalled_s: float) -> str:
        quiet = round(stalled_s)
        if not self.existed and reading.untouched:
            return "run_not_found_at_start"  # said at start-up (warn_if_unknown)
        dropped = reading.zero_variance - before.zero_variance
        if dropped > 0:
            total = reading.zero_variance + reading.scored
            share = reading.zero_variance / total if total else 1.0
            log.warning("groups_all_zero_variance", run=self.run, role=self.role,
                        quiet_s=quiet, dropped=dropped, run_share=round(share, 3), message=(
                            f"all {dropped} groups scored in the last {quiet} s were dropped "
                            f"as zero-variance ({share:.0%} of the run's groups): every "
                            "completion of a group got the same reward, so GRPO has nothing "
                            "to learn from; use a reward with partial credit, a larger "
                            "--group-size, easier or harder items, or zero_variance: keep"))
            return "groups_all_zero_variance"
        if self.feeder is not None and self.feeder.last_state is not None:
            state = self.feeder.last_state
            plan = self.feeder.plan
            if state.free(plan) == 0:
                self._warn_budget(reading, quiet)
                return "admission_budget_exhausted"
        if reading.admitted and not reading.in_flight:
            log.info("run_idle", run=self.run, role=self.role, quiet_s=quiet,
                     admitted=reading.admitted, message=(
                         f"nothing in flight for {quiet} s: every admitted group was "
                         "consumed or dropped; the feeder has finished its epochs or is not "
                         "running"))
            return "run_idle"
        log.warning("run_stalled", run=self.run, role=self.role, quiet_s=quiet,
                    admitted=reading.admitted, scored=reading.scored,
                    consumed=reading.consumed, traj_entries=reading.unscored,
                    scored_entries=reading.unconsumed, drops=reading.drops,
                    trainer_waiting_groups=reading.trainer_waiting, message=(
                        f"no group scored or consumed for {quiet} s (admitted "
                        f"{reading.admitted}, scored {reading.scored}, consumed "
                        f"{reading.consumed}; {reading.unscored} traj and "
                        f"{reading.unconsumed} scored entries): check that workers, a "
                        "scorer and a trainer run on this run (rollq status)"))
        return "run_stalled"

    def _warn_budget(self, reading: Reading, quiet: int) -> None:
        assert self.feeder is not None and self.feeder.last_state is not None
        state, plan = self.feeder.last_state, self.feeder.plan
        budget = (plan.max_staleness + state.version + 1) * plan.batch_groups
        wanted = reading.trainer_waiting
        cause = (f"admission budget exhausted: (max_staleness {plan.max_staleness} + "
                 f"policy_version {state.version} + 1) × batch_groups {plan.batch_groups} = "
                 f"{budget}, all consumed ({state.consumed}) or outstanding "
                 f"({state.outstanding}), and nothing consumed for {quiet} s")
        if wanted is not None and wanted > state.outstanding:
            cause += (f"; the trainer waits for {wanted} groups per step but at most "
                      f"{state.outstanding} are outstanding: a deadlock. feed "
                      f"--batch-groups {plan.batch_groups} must be at least the trainer's "
                      f"{wanted}")
        else:
            cause += ("; is the trainer running, and does it publish its policy version "
                      "(publish_policy) as it steps?")
        log.warning("admission_budget_exhausted", run=self.run, role=self.role, quiet_s=quiet,
                    budget=budget, consumed=state.consumed, outstanding=state.outstanding,
                    policy_version=state.version, batch_groups=plan.batch_groups,
                    trainer_waiting_groups=wanted, message=cause)

    async def watch(self) -> None:
        """Check every ``check_s`` until cancelled; a check that cannot reach Redis is
        skipped (the role's outage rider reports the outage)."""
        while True:
            with contextlib.suppress(BrokerUnavailable):
                await self.check()
            await asyncio.sleep(self.check_s)


async def warn_if_unknown(redis: aioredis.Redis, run: str, role: str) -> bool:
    """Whether ``run`` exists (some role worked on it: ``schemas.runs.run_started``) as
    ``role`` starts; when not, ONE WARNING at once: the known runs and how a run comes to
    exist."""
    if await run_started(redis, run):
        return True
    known = await known_runs(redis)
    others = [name for name in known if name != run]
    log.warning("run_not_found_at_start", run=run, role=role, known_runs=others,
                message=unknown_run_message(run, role, known))
    return False


@contextlib.asynccontextmanager
async def watching(watchdog: RunWatchdog) -> AsyncIterator[RunWatchdog]:
    """Run ``watchdog`` beside the block; a bug in it is raised when the block ends."""
    async with beside(watchdog.watch(), name=f"rollq-watchdog-{watchdog.role}"):
        yield watchdog
