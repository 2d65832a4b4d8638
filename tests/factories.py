"""Builders for wire messages used across tests."""

from __future__ import annotations

import uuid

import numpy as np

from rollq.schemas import Completion, ScoredGroup, SequenceScore, TrajectoryGroup


def make_group(
    *,
    run: str = "test",
    group_size: int = 4,
    tokens: int = 8,
    group_id: str | None = None,
    policy_version: int = 0,
    texts: list[str] | None = None,
    metadata: dict[str, object] | None = None,
    seed: int = 0,
    vocab: int = 50_000,
) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    completions = tuple(
        Completion(
            completion_ids=rng.integers(0, vocab, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            loss_mask=np.ones(tokens, np.uint8),
            policy_version=policy_version,
            finish_reason="stop",
            text=texts[i] if texts else f"completion {i}",
        )
        for i in range(group_size)
    )
    return TrajectoryGroup(
        group_id=group_id or uuid.uuid4().hex,
        run=run,
        env="toy",
        policy_version=policy_version,
        prompt_ids=rng.integers(0, vocab, 5, dtype=np.int32),
        prompt_text="what is 1+1?",
        completions=completions,
        metadata=metadata or {"answer": "2"},
    )


def score(group: TrajectoryGroup, rewards: list[float] | None = None) -> ScoredGroup:
    rewards = rewards or [float(i) for i in range(len(group.completions))]
    mean = sum(rewards) / len(rewards)
    return ScoredGroup(
        trajectory=group,
        scores=tuple(
            SequenceScore(
                reward=r,
                advantage=r - mean,
                token_advantages=np.full(len(c.completion_ids), r - mean, np.float32),
                components={"toy": r},
            )
            for r, c in zip(rewards, group.completions, strict=True)
        ),
        weights={"toy": 1.0},
        reward_config="toy",
    )
