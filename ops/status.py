"""``rollq status``: what a run's streams hold, who reads them, and what was dropped why."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from rollq.consumers.bus import StreamStats, stream_stats, translated_errors
from rollq.consumers.trainer.client import TRAINER_GROUP
from rollq.ops.health import WorkersHealth, read_health
from rollq.producers.admission import outstanding
from rollq.schemas import DecodeError, breaker, scored_rewards
from rollq.schemas.breaker import Tripped
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    DROP_PREFIX,
    PARTITIONS_FIELD,
    POLICY_VERSION_FIELD,
    STREAM_NAMES,
    counters_key,
    queue_name,
    readmit_key,
    sessions_key,
    state_key,
    stream_key,
    sum_counters,
)


class RunNotFound(LookupError):
    """The run has no state in this Redis."""


@dataclass(frozen=True)
class Accounting:
    """Where every admitted group is: the check that finds groups a Redis crash lost.

    ``admitted = consumed + dropped + in flight`` must hold, where in flight is what the
    queue and the streams hold: rollout jobs in arq's queue (waiting, running or retrying),
    external session groups still open on a gateway (``rollq gateway --sessions``), traj
    entries the scorers have not finished, scored entries the trainers have not acked.
    Races between reads only make ``held`` larger (a job is still queued when its group is
    already on the stream), and so do duplicates of a re-run job, so ``unaccounted > 0``
    means groups are really missing: writes lost when redis-server died between two AOF
    fsyncs (``appendfsync everysec``: up to about a second), or keys deleted by hand.
    """

    expected: int
    """``admitted − consumed − dropped``: groups that should be in flight."""
    jobs: int
    """Rollout jobs in the run's arq queue."""
    unscored: int | None
    """Traj entries pending or not yet read by the ``scorers`` group (None: unknown)."""
    unconsumed: int | None
    """Scored entries pending or not yet read by the ``trainer`` group (None: unknown)."""
    sessions: int = 0
    """External session groups open (admitted, not yet published or dead-lettered)."""
    waiting: int = 0
    """Requeued rollout jobs waiting in the readmit lists for the feeder."""

    @property
    def held(self) -> int | None:
        if self.unscored is None or self.unconsumed is None:
            return None
        return self.jobs + self.waiting + self.sessions + self.unscored + self.unconsumed

    @property
    def unaccounted(self) -> int | None:
        """Admitted groups found nowhere (0 when everything is accounted for)."""
        return None if self.held is None else max(0, self.expected - self.held)


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
    accounting: Accounting | None = None
    workers: WorkersHealth | None = None
    """The run's live worker processes and their jobs (arq's health records)."""
    breaker: Tripped | None = None
    """The open circuit breaker: why the feeder stopped admitting (None: admitting)."""
    taken_at: float = field(default_factory=time.time)

    @property
    def drops(self) -> dict[str, int]:
        return {k[len(DROP_PREFIX):]: v for k, v in sorted(self.counters.items())
                if k.startswith(DROP_PREFIX)}

    def as_dict(self) -> dict[str, Any]:
        document = {**asdict(self), "drops": self.drops}
        if self.accounting is not None:
            document["accounting"] |= {"held": self.accounting.held,
                                       "unaccounted": self.accounting.unaccounted}
        return document


async def collect_status(redis: aioredis.Redis, run: str, reward_window: int = 64, *,
                         queue: aioredis.Redis | None = None) -> RunStatus:
    """Gather a run's status; raises ``RunNotFound`` when the run does not exist.
    ``queue``: the control plane holding arq's queue, when it is not ``redis``."""
    async with translated_errors("reading run state"):
        state = await redis.hgetall(state_key(run))
    if not state:
        raise RunNotFound(run)
    partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
    async with translated_errors("reading counters"):
        counters = sum_counters([await redis.hgetall(counters_key(run, p))
                                 for p in range(partitions)])
    streams: list[StreamStats] = []
    rewards: list[float] = []
    for p in range(partitions):
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
    admitted = int(state.get(ADMITTED_FIELD.encode(), b"0"))
    async with translated_errors("reading the job queue"):
        jobs = int(await (queue or redis).zcard(queue_name(run)))
        waiting = sum([int(await redis.llen(readmit_key(run, p))) for p in range(partitions)])
    async with translated_errors("counting open session groups"):
        sessions = sum([int(await redis.zcard(sessions_key(run, p))) for p in range(partitions)])
    async with translated_errors("reading the workers' health"):
        workers = await read_health(queue or redis, run)
    return RunStatus(
        run=run,
        partitions=partitions,
        policy_version=int(state.get(POLICY_VERSION_FIELD.encode(), b"0")),
        admitted=admitted,
        counters=counters,
        streams=streams,
        reward_mean=float(np.mean(rewards)) if rewards else None,
        reward_samples=len(rewards),
        accounting=Accounting(
            expected=outstanding(admitted, counters)[1], jobs=jobs, waiting=waiting,
            sessions=sessions,
            unscored=_not_done(streams, "traj", "scorers"),
            unconsumed=_not_done(streams, "scored", TRAINER_GROUP, any_group=True)),
        workers=workers,
        breaker=await breaker.read(redis, run),
    )


def _not_done(streams: list[StreamStats], name: str, group: str, *,
              any_group: bool = False) -> int | None:
    """Entries of the run's ``name`` streams that ``group`` has not acked (pending + lag);
    every entry when the group does not exist yet; None when Redis cannot tell the lag.

    ``any_group``: when ``group`` does not exist, the consumer groups that do stand in for
    it, the one furthest behind counting: the trainers of an Atropos API run read the
    scored stream as ``atropos`` (``--consumer-group``), not as ``trainer``. Furthest behind,
    so that ``held`` only errs on the large side (``Accounting``)."""
    total = 0
    for stream in streams:
        if not stream.key.endswith(":" + name):
            continue
        found = [g for g in stream.groups if g.name == group] or (
            stream.groups if any_group else [])
        if not found:
            total += stream.length
        elif any(g.lag is None for g in found):
            return None
        else:
            total += max(g.pending + (g.lag or 0) for g in found)
    return total


def render_status(status: RunStatus, previous: RunStatus | None = None) -> str:
    """Human-readable status; with ``previous``, counters also show rates per second."""
    lines = [] if status.breaker is None else [
        f"STOPPED: {status.breaker.explain(status.run)}"]
    lines += [
        f"run {status.run}: {status.partitions} partition(s), policy_version "
        f"{status.policy_version}, admitted {status.admitted}, "
        f"scored {status.counters.get('scored', 0)} (forwarded to the trainer; drops below), "
        f"consumed {status.counters.get('consumed', 0)}"
        f", requeued {status.counters.get('requeued', 0)}"
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
    if status.workers is not None:
        w = status.workers
        waiting = (f", {w.waiting} waiting for their inference servers (no job taken yet: "
                   "start vLLM, or check --inference)" if w.waiting else "")
        lines.append(f"workers: {w.alive} alive{waiting}, jobs {w.running} running, "
                     f"{w.queued} queued, {w.complete} complete, {w.failed} failed, "
                     f"{w.retried} retried")
    accounting = status.accounting
    if accounting is not None:
        held = "?" if accounting.held is None else str(accounting.held)
        lines.append(
            f"in flight: {accounting.expected} expected (admitted − consumed − dropped), "
            f"{held} found: {accounting.jobs} jobs, "
            + (f"{accounting.waiting} requeued jobs waiting for admission, "
               if accounting.waiting else "")
            + (f"{accounting.sessions} open session groups, " if accounting.sessions else "")
            + f"{accounting.unscored} unscored, "
            f"{accounting.unconsumed} unconsumed")
        if accounting.unaccounted:
            lines.append(
                f"WARNING: {accounting.unaccounted} admitted group(s) are in no queue, stream "
                "or dead letter: lost by Redis (a crash between AOF fsyncs loses up to ~1 s "
                "of writes under appendfsync everysec) or deleted by hand")
    drops = status.drops
    lines.append("drops by reason: " + (", ".join(f"{k} {v}" for k, v in drops.items())
                                        if drops else "none"))
    return "\n".join(lines)
