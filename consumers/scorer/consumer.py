"""The scoring consumer: traj stream → reward bridge → scored stream, exactly once.

It reads the run's traj streams as consumer group ``scorers`` through a ``Stage``, so
several scorer processes share the work, a crashed scorer's entries are reclaimed, and
the forward script forwards each group once. Per group (the ``Stage`` maps failures
through ``schemas.failures``):

- undecodable / unknown version → dead letter at once;
- missing reward metadata (``MissingFieldError``) → dead letter ``reward_missing_field``
  at once;
- a component that still fails after its in-process retries under ``on_error:
  dead_letter`` (the reward is unknown, never 0) → left pending and retried by reclaim,
  then dead-lettered ``reward_error`` with the component's name in the detail;
- Redis unavailable while counting flags → left pending (retry);
- a zero-variance group under ``zero_variance: drop`` → dropped, counted by reason;
- otherwise a ``ScoredGroup`` with rewards, each component's raw values, advantages and
  per-token advantages is forwarded, in reference form: the scored entry names the traj
  entry instead of copying its token arrays (``schemas.codec``). Components skipped by
  ``on_error: skip_component`` are flagged in the entry and counted under
  ``flag:<component>:<reason>``.

The scorer offers the ``Stage`` a ``batch_transform``: each read's groups are scored
together in one ``score_groups`` call (a component scoped to the batch, ``scope: batch``,
sees all of them; one scoped to the group still sees only its group), and each group is
still forwarded, dropped or failed on its own. One call per read rather than a task per
entry: inline components then run as one plain loop over the read's samples, and pool or
HTTP components get the whole read's samples at once.

No signal, no spending: with a ``run`` and a ``zero_variance_breaker`` above 0, each read
also extends the run's zero-variance streak (``schemas.breaker``): the groups dropped as
zero-variance since the last forwarded group. When it reaches the setting, the scorer trips
the run's circuit breaker, the feeder admits nothing more and every role logs one ERROR
line saying what it means and what to do.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence

import orjson
import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import Delivery, translated_errors
from rollq.consumers.scorer.bridge import GroupScore, RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.errors import ScoringError
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.stage import BatchTransform, Drop, Forward, Outcome
from rollq.schemas import (
    BrokerUnavailable,
    Fields,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
    breaker,
    encode_scores,
)
from rollq.schemas.columns import TrajectoryColumns
from rollq.schemas.decoding import decode_trajectory_columns
from rollq.schemas.keys import partner_key

log = structlog.get_logger("rollq.scorer")


def config_fingerprint(config: RewardConfig) -> str:
    """A short stable name for a reward config, stamped on every scored group."""
    document = orjson.dumps(config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(document).hexdigest()[:12]


def scored_group(group: TrajectoryGroup, score: GroupScore, config_name: str) -> ScoredGroup:
    """Combine a trajectory group and its scores into the wire message."""
    assert score.advantages is not None and score.token_advantages is not None
    names = list(score.components)
    return ScoredGroup(
        trajectory=group,
        scores=tuple(
            SequenceScore(
                reward=score.rewards[i],
                advantage=float(score.advantages[i]),
                token_advantages=score.token_advantages[i],
                token_rewards=None if score.token_rewards is None else score.token_rewards[i],
                components={name: score.components[name][i] for name in names},
            )
            for i in range(len(group.completions))
        ),
        weights=dict(score.weights),
        flags=_flag_names(score),
        reward_config=config_name,
        scored_at=time.time(),
    )


def _flag_names(score: GroupScore) -> list[str]:
    return [f"{f.component}:{f.reason}:sample{f.sample}" for f in score.flags]


class Scorer:
    """The transform a scoring ``Stage`` runs on each traj entry."""

    def __init__(self, bridge: RewardBridge, config_name: str,
                 redis: aioredis.Redis | None = None, *, run: str | None = None,
                 zero_variance_breaker: int = 0,
                 notice: breaker.Notice | None = None) -> None:
        self.bridge = bridge
        self.config_name = config_name
        self.redis = redis
        """Where flags are counted; None: not counted (rescore, tests)."""
        self.run = run
        """The run whose zero-variance streak the reads extend (None: none is kept)."""
        self.zero_variance_breaker = zero_variance_breaker
        """Consecutive zero-variance drops that trip the run's breaker (0: never)."""
        self.notice = notice or (breaker.Notice(run, "scorer", log) if run else None)
        """Logs the breaker this scorer trips (shared with the role's watchdog: one line)."""

    @property
    def batch_transform(self) -> BatchTransform:
        """``transform_batch``: the ``Stage`` hands it each read whole (module docstring)."""
        return self.transform_batch

    def samples(self, group: TrajectoryGroup | TrajectoryColumns) -> list[Sample]:
        """The bridge's samples of a group's completions (from its models, or from the
        decoded columns of its entry: ``schemas.columns``)."""
        make = self.bridge.make_sample
        if isinstance(group, TrajectoryColumns):
            meta, ids = group.meta, group.completion_ids
            return [
                make(text, ids[a:b], reasoning=info["reasoning"],
                     finish_reason=info["finish_reason"], metadata=meta["metadata"],
                     prompt=meta["prompt_text"], completion_metadata=info["info"])
                for text, info, (a, b) in zip(group.texts, meta["completions"],
                                              itertools.pairwise(group.offsets), strict=True)
            ]
        return [
            make(c.text, c.completion_ids, reasoning=c.reasoning, finish_reason=c.finish_reason,
                 metadata=group.metadata, prompt=group.prompt_text, completion_metadata=c.info)
            for c in group.completions
        ]

    def finish(self, group: TrajectoryGroup, score: GroupScore) -> ScoredGroup | str:
        """The scored message of a scored group, or the reason it is dropped."""
        if score.drop_reason is not None:
            return score.drop_reason
        log.debug("group_scored", group_id=group.group_id, timings=score.timings,
                  mean_reward=sum(score.rewards) / len(score.rewards))
        return scored_group(group, score, self.config_name)

    def entry(self, group: TrajectoryGroup | TrajectoryColumns, score: GroupScore,
              trajectory_id: str) -> tuple[Fields, list[str]] | str:
        """What ``finish`` gives, as the scored stream's reference-form entry (and its
        flags) written straight from the scores: no ``ScoredGroup`` is built on the way
        (``schemas.encode_scores`` checks every value as ``encode`` does)."""
        if score.drop_reason is not None:
            return score.drop_reason
        log.debug("group_scored", group_id=group.group_id, timings=score.timings,
                  mean_reward=sum(score.rewards) / len(score.rewards))
        assert score.advantages is not None and score.token_advantages is not None
        names = list(score.components)
        flags = _flag_names(score)
        fields = encode_scores(
            group, rewards=score.rewards, advantages=score.advantages.tolist(),
            token_advantages=score.token_advantages, token_rewards=score.token_rewards,
            components=[{name: score.components[name][i] for name in names}
                        for i in range(len(score.rewards))],
            weights=dict(score.weights), flags=flags, reward_config=self.config_name,
            scored_at=time.time(), trajectory_id=trajectory_id)
        return fields, flags

    async def score(self, group: TrajectoryGroup) -> ScoredGroup | str:
        """Score a group: the scored message, or the reason it is dropped. Raises
        ``ScoringError`` when it cannot be scored (see the module docstring)."""
        return self.finish(group, await self.bridge.score_group(self.samples(group)))

    async def score_many(
        self, groups: Sequence[TrajectoryGroup]
    ) -> list[ScoredGroup | str | ScoringError]:
        """Score groups together (one ``score_groups`` call; ``scope: batch`` components see
        all of them): per group, its scored message, the reason it is dropped, or the
        ``ScoringError`` it failed with."""
        scores = await self.bridge.score_groups([self.samples(group) for group in groups])
        return [score if isinstance(score, ScoringError) else self.finish(group, score)
                for group, score in zip(groups, scores, strict=True)]

    async def __call__(self, delivery: Delivery) -> Outcome:
        """One delivery on its own: ``transform_batch`` of a read of one (its failure
        raised)."""
        [result] = await self.transform_batch([delivery])
        if isinstance(result, Exception):
            raise result
        return result

    async def transform_batch(self, deliveries: Sequence[Delivery]) -> list[Outcome | Exception]:
        """Score a read's groups together; one result per delivery (see ``Stage``)."""
        results: list[Outcome | Exception | None] = [None] * len(deliveries)
        decoded: list[tuple[int, TrajectoryColumns]] = []
        samples: list[list[Sample]] = []
        for index, delivery in enumerate(deliveries):
            try:  # checked in full, not assembled into models: none is needed on the way
                group = decode_trajectory_columns(delivery.fields)
                samples.append(self.samples(group))
                decoded.append((index, group))
            except Exception as exc:  # the Stage sorts it (decode_error, or a bug)
                results[index] = exc
        scores = await self.bridge.score_groups(samples)
        flagged: list[tuple[Delivery, Sequence[str]]] = []
        flagged_at: list[int] = []
        for (index, group), score in zip(decoded, scores, strict=True):
            if isinstance(score, ScoringError):
                results[index] = score
                continue
            try:
                result = self.entry(group, score, deliveries[index].entry_id)
            except Exception as exc:  # the Stage sorts it (contract_error, or a bug)
                results[index] = exc
                continue
            if isinstance(result, str):
                results[index] = Drop(result)
            else:
                fields, flags = result
                if flags:
                    flagged.append((deliveries[index], flags))
                    flagged_at.append(index)
                results[index] = Forward(fields)
        try:
            await self._count_flags(flagged)
        except Exception as exc:  # those entries are retried; the read's others go on
            for index in flagged_at:
                results[index] = exc
        settled = [result for result in results if result is not None]
        await self._count_zero_variance(settled)
        return settled

    async def _count_zero_variance(self, results: Sequence[Outcome | Exception]) -> None:
        """Extend the run's zero-variance streak by this read (module docstring); best
        effort: a Redis outage is the role's outage rider's to report, and the next read
        counts again."""
        if self.redis is None or self.run is None or self.notice is None:
            return
        forwarded = any(isinstance(r, Forward) for r in results)
        tail = list(itertools.takewhile(lambda r: not isinstance(r, Forward), reversed(results)))
        dropped = sum(1 for r in tail if isinstance(r, Drop) and r.reason == breaker.ZERO_VARIANCE)
        if not forwarded and not dropped:
            return
        try:
            tripped = await breaker.record_zero_variance(
                self.redis, self.run, forwarded=forwarded, dropped=dropped,
                threshold=self.zero_variance_breaker)
        except BrokerUnavailable as exc:
            log.debug("zero_variance_not_counted", run=self.run, error=str(exc))
            return
        if tripped is not None:
            self.notice.seen(tripped)

    async def _count_flags(self, flagged: Sequence[tuple[Delivery, Sequence[str]]]) -> None:
        # Flags are informational (the group is still forwarded), so they are counted with
        # plain HINCRBYs before the forward. A Redis failure here raises BrokerUnavailable:
        # the entries are left pending and retried, which may count their flags again.
        if self.redis is None or not flagged:
            return
        async with translated_errors("counting reward flags"):
            pipe = self.redis.pipeline(transaction=False)
            for delivery, flags in flagged:
                key = partner_key(delivery.stream, "counters")
                for flag in flags:
                    component, reason, _ = flag.split(":", 2)
                    pipe.hincrby(key, f"flag:{component}:{reason}", 1)
            await pipe.execute()
