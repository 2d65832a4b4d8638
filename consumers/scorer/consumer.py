"""The scoring consumer: traj stream → reward bridge → scored stream, exactly once.

It reads the run's traj streams as consumer group ``scorers`` through a ``Stage``, so
several scorer processes share the work, a crashed scorer's entries are reclaimed, and
the forward script forwards each group once. Per group:

- undecodable / unknown version → dead letter (``Stage``);
- a component failing under ``on_error: dead_letter``, or missing gold metadata →
  dead letter with the ``RewardError``'s reason;
- a zero-variance group under ``zero_variance: drop`` → dropped, counted by reason;
- otherwise a ``ScoredGroup`` with rewards, each component's raw values, advantages and
  per-token advantages is forwarded, in reference form: the scored entry names the traj
  entry instead of copying its token arrays (``schemas.codec``). Components scored 0 by
  the ``zero`` policy are flagged in the entry and counted under
  ``flag:<component>:<reason>``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import orjson
import redis.asyncio as aioredis
import structlog

from consumers.bus import Delivery
from consumers.scorer.bridge import GroupScore, RewardBridge
from consumers.scorer.config import RewardConfig
from consumers.stage import Drop, Forward, Outcome
from schemas import ScoredGroup, SequenceScore, TrajectoryGroup, decode_trajectory, encode
from schemas.keys import partner_key

log = structlog.get_logger("rollq.scorer")


def config_fingerprint(config: RewardConfig) -> str:
    """A short stable name for a reward config, stamped on every scored group."""
    document = orjson.dumps(config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(document).hexdigest()[:12]


def to_scored(group: TrajectoryGroup, score: GroupScore, config_name: str) -> ScoredGroup:
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
        flags=[f"{f.component}:{f.reason}:sample{f.sample}" for f in score.flags],
        reward_config=config_name,
        scored_at=time.time(),
    )


class Scorer:
    """The transform a scoring ``Stage`` runs on each traj entry."""

    def __init__(self, bridge: RewardBridge, config_name: str,
                 redis: aioredis.Redis | None = None) -> None:
        self.bridge = bridge
        self.config_name = config_name
        self.redis = redis
        """Where flags are counted; None: not counted (rescore into a file, tests)."""

    async def score(self, group: TrajectoryGroup) -> ScoredGroup | str:
        """Score a group: the scored message, or the reason it is dropped."""
        samples = [
            self.bridge.make_sample(
                c.text, c.completion_ids, reasoning=c.reasoning, finish_reason=c.finish_reason,
                metadata=group.metadata, prompt=group.prompt_text, completion_metadata=c.info,
            )
            for c in group.completions
        ]
        score = await self.bridge.score_group(samples)
        if score.drop_reason is not None:
            return score.drop_reason
        log.debug("group_scored", group_id=group.group_id, timings=score.timings,
                  mean_reward=sum(score.rewards) / len(score.rewards))
        return to_scored(group, score, self.config_name)

    async def __call__(self, delivery: Delivery) -> Outcome:
        group = decode_trajectory(delivery.fields)
        result = await self.score(group)
        if isinstance(result, str):
            return Drop(result)
        if result.flags:
            await self._count_flags(delivery, result.flags)
        return Forward(encode(result, trajectory_id=delivery.entry_id))

    async def _count_flags(self, delivery: Delivery, flags: Sequence[str]) -> None:
        # Flags are informational (the group is still forwarded), so they are counted with a
        # plain HINCRBY rather than inside the forward script.
        if self.redis is None:
            return
        key = partner_key(delivery.stream, "counters")
        pipe = self.redis.pipeline(transaction=False)
        for flag in flags:
            component, reason, _ = flag.split(":", 2)
            pipe.hincrby(key, f"flag:{component}:{reason}", 1)
        await pipe.execute()
