"""``rollq rescore``: replay a run's stored trajectories through another reward config into
another run, without regenerating (A/B a reward for free).

The source run's traj streams are read with plain XRANGE (no consumer group: the source run
is untouched), in batches. Each batch is scored in one ``score_groups`` call, so
components with ``scope: batch`` see the whole batch, as under ``rollq score``. Every
group then ends in exactly one of:

- **scored**: its inline-form scored entry is added to the target run's scored stream;
- **dropped**: (e.g. ``zero_variance``) counted under ``drop:<reason>`` in the target;
- **dead letter**: it could not be decoded or scored; ``schemas.failures.decide`` names
  the reason (reward failures are retried ``attempts`` times with back-off first, together
  with the batch's other failed groups), and the letter goes to the TARGET run's dead
  stream with its payload (``consumer_group`` ``rescore``; ``source_stream`` the source
  run's traj stream), counted there under ``drop:<reason>``. The replay goes on.

Target partitions are chosen from each group's id, like a producer would; an entry that
cannot be decoded goes to the partition of its source stream's index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import append_entries, read_range, translated_errors
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.ops.connections import open_redis
from rollq.ops.roles import load_reward_config
from rollq.ops.settings import ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import (
    DeadLetter,
    Fields,
    ScoredGroup,
    TrajectoryGroup,
    decode_trajectory,
    encode,
    encode_dead,
)
from rollq.schemas.failures import Kind, Verdict, backoff_s, classify, decide
from rollq.schemas.keys import (
    DROP_PREFIX,
    SCORED_COUNTER,
    counters_key,
    partition_of,
    stream_key,
    stream_keys,
)

log = structlog.get_logger("rollq.rescore")

RESCORE_GROUP = "rescore"
"""The ``consumer_group`` named in rescore's dead letters (rescore reads without a group)."""


@dataclass
class RescoreResult:
    """What a rescore did, in groups: ``seen`` = ``scored`` + ``dropped`` + ``dead``."""

    total: int = 0
    """Entries in the source traj streams when the replay started."""
    seen: int = 0
    scored: int = 0
    dropped: int = 0
    dead: int = 0

    def line(self) -> str:
        """The progress line."""
        return (f"rescored {self.seen}/{self.total} groups: {self.scored} scored, "
                f"{self.dead} dead, {self.dropped} dropped")


@dataclass
class _Source:
    stream: str
    entry_id: str
    fields: Fields
    partition: int
    group: TrajectoryGroup | None = None


class _Output:
    """What one batch writes into the target run, per target partition."""

    def __init__(self) -> None:
        self.scored: dict[int, list[Fields]] = {}
        self.dead: dict[int, list[Fields]] = {}
        self.counts: dict[int, dict[str, int]] = {}

    def count(self, partition: int, counter: str) -> None:
        counts = self.counts.setdefault(partition, {})
        counts[counter] = counts.get(counter, 0) + 1


class Rescorer:
    """Scores batches of source entries into the target run ``into``."""

    def __init__(self, redis: aioredis.Redis, scorer: Scorer, into: str, partitions: int, *,
                 attempts: int = 3, backoff_base_s: float = 0.5) -> None:
        self.redis = redis
        self.scorer = scorer
        self.into = into
        self.partitions = partitions
        """The target run's partition count."""
        self.attempts = attempts
        """Tries of a group whose reward failed (retryable) before it is dead-lettered."""
        self.backoff_base_s = backoff_base_s
        self.result = RescoreResult()

    async def rescore(self, stream: str, partition: int,
                      entries: Sequence[tuple[str, Fields]]) -> None:
        """Score one batch read from source ``stream`` (partition ``partition``) and write
        what it gives into the target run."""
        output = _Output()
        sources: list[_Source] = []
        for entry_id, fields in entries:
            source = _Source(stream, entry_id, fields, partition % self.partitions)
            self.result.seen += 1
            try:
                source.group = decode_trajectory(fields).model_copy(update={"run": self.into})
            except Exception as exc:  # decoding is deterministic: never retried
                self._dead_letter(output, source, decide(
                    exc, attempt=1, max_attempts=1, retry_unexpected=False), exc)
                continue
            source.partition = partition_of(source.group.group_id, self.partitions)
            sources.append(source)
        attempt = 1
        while sources:
            retry: list[_Source] = []
            for source, result in zip(sources, await self._score(sources), strict=True):
                if isinstance(result, Exception):
                    verdict = decide(result, attempt=attempt, max_attempts=self.attempts,
                                     retry_unexpected=False)
                    if verdict.retry:
                        retry.append(source)
                    else:
                        self._dead_letter(output, source, verdict, result, attempt=attempt)
                elif isinstance(result, str):
                    self.result.dropped += 1
                    output.count(source.partition, DROP_PREFIX + result)
                else:
                    self.result.scored += 1
                    output.scored.setdefault(source.partition, []).append(encode(result))
                    output.count(source.partition, SCORED_COUNTER)
            if retry:
                log.warning("rescore_retried", groups=len(retry), attempt=attempt)
                await asyncio.sleep(backoff_s(attempt, base_s=self.backoff_base_s, cap_s=10.0))
                attempt += 1
            sources = retry
        await self._write(output)

    async def _score(self, sources: Sequence[_Source]) -> list[ScoredGroup | str | Exception]:
        """Each source's scored group, drop reason or exception: one call for all; if that
        call itself fails, one call per group, so the failure stays with its group."""
        groups = [source.group for source in sources if source.group is not None]
        try:
            return list(await self.scorer.score_many(groups))
        except Exception:
            log.exception("rescore_batch_failed", groups=len(groups))
        results: list[ScoredGroup | str | Exception] = []
        for group in groups:
            try:
                results.extend(await self.scorer.score_many([group]))
            except Exception as exc:
                results.append(exc)
        return results

    def _dead_letter(self, output: _Output, source: _Source, verdict: Verdict,
                     exc: Exception, *, attempt: int = 1) -> None:
        if classify(exc).kind is Kind.UNEXPECTED:
            log.error("rescore_group_failed", entry_id=source.entry_id, exc_info=exc)
        letter = DeadLetter(reason=verdict.reason, detail=verdict.detail,
                            source_stream=source.stream, source_id=source.entry_id,
                            consumer_group=RESCORE_GROUP, deliveries=attempt,
                            dead_at=time.time(), payload=dict(source.fields))
        output.dead.setdefault(source.partition, []).append(encode_dead(letter))
        output.count(source.partition, DROP_PREFIX + verdict.reason)
        self.result.dead += 1
        log.warning("rescore_dead_lettered", entry_id=source.entry_id, reason=verdict.reason,
                    detail=verdict.detail)

    async def _write(self, output: _Output) -> None:
        for partition, entries in output.scored.items():
            await append_entries(self.redis, stream_key(self.into, partition, "scored"), entries)
        for partition, entries in output.dead.items():
            await append_entries(self.redis, stream_key(self.into, partition, "dead"), entries)
        if output.counts:
            async with translated_errors("counting rescored groups"):
                pipe = self.redis.pipeline(transaction=False)
                for partition, counts in output.counts.items():
                    for counter, amount in counts.items():
                        pipe.hincrby(counters_key(self.into, partition), counter, amount)
                await pipe.execute()


async def rescore(settings: ScorerSettings, into: str, *, progress: Callable[[str], None],
                  batch: int = 64, attempts: int = 3) -> RescoreResult:
    """Replay the run's stored traj entries through ``settings.reward_config`` into run
    ``into`` (see the module docstring); ``progress`` gets a line after each batch."""
    config = load_reward_config(settings.reward_config, processes=settings.processes)
    redis = open_redis(settings)
    try:
        # register() returns the partition count in force (the source run exists: the CLI
        # checked; its stored count wins over the default).
        partitions = await Publisher(redis, settings.run, settings.partitions).register()
        targets = await Publisher(redis, into, partitions).register()
        sources = stream_keys(settings.run, partitions, "traj")
        async with translated_errors("counting stored trajectories"):
            total = sum([await redis.xlen(source) for source in sources])
        async with RewardBridge(config) as bridge:
            rescorer = Rescorer(redis, Scorer(bridge, config_fingerprint(config)), into,
                                targets, attempts=attempts)
            rescorer.result.total = total
            for partition, source in enumerate(sources):
                async for entries in read_range(redis, source, batch):
                    await rescorer.rescore(source, partition, entries)
                    progress(rescorer.result.line())
        return rescorer.result
    finally:
        await redis.aclose()
