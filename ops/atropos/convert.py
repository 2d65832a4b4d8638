"""An Atropos group (``ScoredData``) <-> a rollq group, field by field, exactly.

Atropos -> rollq (``to_trajectory``): ``producers.envs.atropos_groups`` (the one mapping,
shared with Atropos envs run as rollq envs; ``docs/guides/atropos.md``).

- advantages (``scored_from_atropos``): the posted per-token ``advantages`` after the prompt, the
  sequence advantage their mean over trained tokens; without them GRPO over the scores.
- per-token float fields whose rows are not one value a token (``advantages`` longer
  than its tokens, as atroposlib accepts them): ``set_aside``, kept verbatim for ``/batch``
  and not used for rollq's own arrays (``mismatched_fields`` names them for a warning).

rollq -> Atropos (``to_atropos``) gives back every key of ``ScoredData``, absent ones null.
A field is rebuilt from the arrays only when, at post time, rebuilding it gave the posted
value exactly (float64 equality, so float32-exact logprobs travel as binary); otherwise the
posted JSON is kept verbatim. Groups that came from rollq's own envs come out with
``masks`` from the loss mask, ``scores`` from the rewards, per-token ``advantages`` (0 over
the prompt) and ``inference_logprobs`` (1.0 at untrained positions, atroposlib's filler).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rollq.consumers.scorer.advantages import compute_advantages
from rollq.ops.atropos.models import SCORED_DATA_FIELDS, ScoredData
from rollq.producers.envs.atropos_groups import (
    ENV_SCORE,
    MASKED,
    MASKED_LOGPROB,
    REBUILDABLE,
    InvalidGroup,
    atropos_sequences,
)
from rollq.schemas import ScoredGroup, SequenceScore, TrajectoryGroup

PER_TOKEN_FLOATS = ("advantages", "inference_logprobs")
"""Per-token float fields rollq reads into its own arrays when they fit the tokens."""
ENV_SCORES = "atropos:env_scores"
"""``reward_config`` of scored groups whose rewards are the env's own scores."""
__all__ = [
    "ENV_SCORE",
    "ENV_SCORES",
    "InvalidGroup",
    "mismatched_fields",
    "scored_from_atropos",
    "to_atropos",
    "to_trajectory",
]


def mismatched_fields(data: ScoredData) -> list[str]:
    """The per-token float fields of ``data`` with a row that is not one value a token
    (atroposlib stores such a group as posted; a trainer that indexes by token fails)."""
    tokens = data.tokens
    return [name for name in PER_TOKEN_FLOATS
            if (rows := getattr(data, name)) and len(rows) == len(tokens)
            and any(len(row) != len(seq) for row, seq in zip(rows, tokens, strict=True))]


def set_aside(data: ScoredData) -> tuple[ScoredData, dict[str, Any]]:
    """``data`` without its mismatched per-token fields, and those fields as posted."""
    aside = {name: getattr(data, name) for name in mismatched_fields(data)}
    return (data.model_copy(update=dict.fromkeys(aside)) if aside else data), aside


def to_trajectory(data: ScoredData, *, run: str, env: str, group_id: str,
                  policy_version: int) -> TrajectoryGroup:
    """The rollq trajectory group of a posted Atropos group (see the module docstring).

    Raises ``InvalidGroup`` for a group that is not self-consistent.
    """
    usable, aside = set_aside(data)
    sequences = atropos_sequences(usable.__dict__, policy_version=policy_version)
    sequences.atropos["posted"].update(aside)
    now = time.time()
    try:
        return TrajectoryGroup(
            group_id=group_id, run=run, env=env, policy_version=policy_version,
            prompt_ids=sequences.prompt_ids, completions=sequences.completions,
            metadata={"atropos": sequences.atropos}, created_at=now, finished_at=now,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidGroup(f"invalid group: {exc}") from None


def scored_from_atropos(trajectory: TrajectoryGroup, data: ScoredData) -> ScoredGroup:
    """The group scored with the env's own scores (``--rewards env``)."""
    start = len(trajectory.prompt_ids)
    data, _ = set_aside(data)
    if data.advantages:
        token_advantages = [np.asarray(row[start:], dtype=np.float32)
                            for row in data.advantages]
        sequence = [float(a[c.loss_mask.astype(bool)].mean()) if c.loss_mask.any() else 0.0
                    for a, c in zip(token_advantages, trajectory.completions, strict=True)]
    else:
        advantages = compute_advantages(data.scores)
        sequence = [float(a) for a in advantages]
        token_advantages = [np.full(len(c.completion_ids), a, np.float32)
                            for a, c in zip(advantages, trajectory.completions, strict=True)]
    try:
        return ScoredGroup(
            trajectory=trajectory,
            scores=tuple(
                SequenceScore(reward=float(score), advantage=advantage,
                              token_advantages=token, components={ENV_SCORE: float(score)})
                for score, advantage, token in zip(data.scores, sequence, token_advantages,
                                                   strict=True)),
            weights={ENV_SCORE: 1.0}, reward_config=ENV_SCORES, scored_at=time.time(),
        )
    except ValueError as exc:
        raise InvalidGroup(f"invalid group: {exc}") from None


def to_atropos(group: ScoredGroup) -> dict[str, Any]:
    """The group as Atropos' ``/batch`` gives it: every ``ScoredData`` key, absent ones null.

    Token arrays come back as numpy arrays (serialise with ``orjson.OPT_SERIALIZE_NUMPY``);
    float arrays as float64, so float32-exact posted values read back identical.
    """
    trajectory = group.trajectory
    prompt = trajectory.prompt_ids
    start = len(prompt)
    found = trajectory.metadata.get("atropos")
    own = isinstance(found, dict)
    meta: dict[str, Any] = found if isinstance(found, dict) else {}
    rebuilt = set(meta.get("rebuilt", ())) if own else set(REBUILDABLE)
    posted: dict[str, Any] = dict(meta.get("posted") or {}) if own else {}
    env_scores = group.reward_config == ENV_SCORES
    tokens, masks, logprobs, advantages = [], [], [], []
    for completion, score in zip(trajectory.completions, group.scores, strict=True):
        sequence = np.concatenate([prompt, completion.completion_ids])
        trained = np.concatenate([np.zeros(start, bool), completion.loss_mask.astype(bool)])
        tokens.append(sequence)
        masks.append(np.where(trained, sequence, MASKED).astype(np.int32))
        logprobs.append(np.where(
            trained, np.concatenate([np.zeros(start, np.float32), completion.logprobs]),
            MASKED_LOGPROB).astype(np.float64))
        advantages.append(np.concatenate(
            [np.zeros(start), score.token_advantages.astype(np.float64)]))
    out: dict[str, Any] = dict.fromkeys(SCORED_DATA_FIELDS)
    out.update(posted)
    out["tokens"] = tokens
    if "masks" in rebuilt:
        out["masks"] = masks
    if "inference_logprobs" in rebuilt:
        out["inference_logprobs"] = logprobs
    if own and env_scores:
        out["scores"] = [c.info.get(ENV_SCORE, s.reward)
                         for c, s in zip(trajectory.completions, group.scores, strict=True)]
        if "advantages" in rebuilt:
            out["advantages"] = advantages
    else:
        out["scores"] = [s.reward for s in group.scores]
        out["advantages"] = advantages
    out["env_id"] = meta.get("env_id") if own else None
    return out
