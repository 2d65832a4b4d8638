"""An Atropos group (``ScoredData``) <-> a rollq group, field by field, exactly.

Atropos -> rollq (``to_trajectory``, ``to_scored``):

- ``prompt_ids``: the longest prefix that is masked (-100) in every sequence and equal
  across them; each sequence's tokens after it are its ``completion_ids``.
- ``loss_mask``: 1 where ``masks`` is not -100 (Atropos masks are labels: the token id
  where trained, -100 elsewhere).
- ``logprobs``: ``inference_logprobs`` at trained tokens (float32), 0.0 elsewhere; all 0.0
  when the env sent none.
- rewards: ``scores``; each sequence's posted score is also kept exactly in
  ``completions[i].info["env_score"]`` (the ``env_score`` reward component reads it).
- advantages (``to_scored``): the posted per-token ``advantages`` after the prompt, the
  sequence advantage their mean over trained tokens; without them GRPO over the scores.
- ``text``: the content of the last assistant message when ``messages`` are given.
- ``metadata["atropos"]``: ``env_id``, ``rebuilt`` (the per-token fields that rebuild
  exactly from the binary arrays) and ``posted`` (every other non-null field, verbatim).
- An optional per-sequence field posted as an empty list (atroposlib's default
  ``collect_trajectories`` sends ``advantages``, ``ref_logprobs``, ``overrides`` and
  ``images`` that way when no rollout set them) means "none" and comes back as ``[]``.

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
from numpy.typing import NDArray

from consumers.scorer.advantages import compute_advantages
from ops.atropos.models import SCORED_DATA_FIELDS, ScoredData
from schemas import Completion, ContractError, ScoredGroup, SequenceScore, TrajectoryGroup

ENV_SCORES = "atropos:env_scores"
"""``reward_config`` of scored groups whose rewards are the env's own scores."""
ENV_SCORE = "env_score"
"""Key of each completion's posted score in ``Completion.info`` (and component name)."""
MASKED = -100
_MASKED_LOGPROB = 1.0  # atroposlib's value at untrained positions of inference_logprobs
_MAX_TOKEN = 2**31 - 1
_PER_SEQUENCE = ("masks", "scores", "advantages", "ref_logprobs", "messages",
                 "inference_logprobs", "overrides", "distill_token_ids", "distill_logprobs")
_REBUILDABLE = ("masks", "inference_logprobs", "advantages")


class InvalidGroup(ContractError):
    """A posted group that cannot be stored (answered 422, never stored)."""


def prompt_length(tokens: list[NDArray[np.int64]], masks: list[NDArray[np.int64]]) -> int:
    """Length of the longest prefix masked in every sequence and equal across them."""
    shortest = min(len(t) for t in tokens)
    if shortest == 0:
        return 0
    head = np.stack([t[:shortest] for t in tokens])
    masked = np.stack([m[:shortest] for m in masks]) == MASKED
    shared = masked.all(axis=0) & (head == head[0]).all(axis=0)
    return shortest if shared.all() else int(np.argmin(shared))


def _check(data: ScoredData) -> tuple[list[NDArray[np.int64]], list[NDArray[np.int64]]]:
    count = len(data.tokens)
    if count == 0:
        raise InvalidGroup("tokens is empty: a group needs at least one sequence")
    for name in _PER_SEQUENCE:
        value = getattr(data, name)
        if name not in ("masks", "scores") and value == []:
            continue  # atroposlib's default collect_trajectories sends unused ones empty
        if value is not None and len(value) != count:
            raise InvalidGroup(f"{name} has {len(value)} entries for {count} sequences")
    tokens = [np.asarray(t, dtype=np.int64) for t in data.tokens]
    masks = [np.asarray(m, dtype=np.int64) for m in data.masks]
    for i, (t, m) in enumerate(zip(tokens, masks, strict=True)):
        if len(m) != len(t):
            raise InvalidGroup(f"masks[{i}] has {len(m)} values for {len(t)} tokens")
        if len(t) and (t.min() < 0 or t.max() > _MAX_TOKEN):
            raise InvalidGroup(f"tokens[{i}] holds an id outside 0..{_MAX_TOKEN}")
        if not ((m == MASKED) | ((m >= 0) & (m <= _MAX_TOKEN))).all():
            raise InvalidGroup(f"masks[{i}] holds a value that is neither -100 nor a token "
                               f"id (0..{_MAX_TOKEN})")
    for name in ("inference_logprobs", "advantages"):
        for i, row in enumerate(getattr(data, name) or ()):
            if len(row) != len(tokens[i]):
                raise InvalidGroup(f"{name}[{i}] has {len(row)} values for "
                                   f"{len(tokens[i])} tokens")
            if not np.isfinite(np.asarray(row, dtype=np.float64)).all():
                raise InvalidGroup(f"{name}[{i}] holds a non-finite value")
    if not np.isfinite(np.asarray(data.scores, dtype=np.float64)).all():
        raise InvalidGroup("scores holds a non-finite value")
    return tokens, masks


def _exact_f32(values: list[float]) -> NDArray[np.float64]:
    return np.asarray(values, dtype=np.float64)


def _last_assistant_text(conversation: list[dict[str, Any]]) -> str:
    for message in reversed(conversation):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


def to_trajectory(data: ScoredData, *, run: str, env: str, group_id: str,
                  policy_version: int) -> TrajectoryGroup:
    """The rollq trajectory group of a posted Atropos group (see the module docstring).

    Raises ``InvalidGroup`` for a group that is not self-consistent.
    """
    tokens, masks = _check(data)
    start = prompt_length(tokens, masks)
    rebuilt: list[str] = []
    trainable = [m != MASKED for m in masks]
    if all(np.array_equal(np.where(k, t, MASKED), m)
           for t, m, k in zip(tokens, masks, trainable, strict=True)):
        rebuilt.append("masks")
    logprobs: list[NDArray[np.float32]] = [np.zeros(len(t) - start, np.float32) for t in tokens]
    if data.inference_logprobs:
        exact = True
        for i, row in enumerate(data.inference_logprobs):
            posted = _exact_f32(row)
            as_f32 = np.where(trainable[i], posted, 0.0).astype(np.float32)
            logprobs[i] = as_f32[start:]
            again = np.where(trainable[i], as_f32.astype(np.float64), _MASKED_LOGPROB)
            exact = exact and np.array_equal(again, posted)
        if exact:
            rebuilt.append("inference_logprobs")
    if data.advantages and all(
            np.array_equal(np.concatenate([np.zeros(start), _exact_f32(row)[start:]
                                           .astype(np.float32).astype(np.float64)]),
                           _exact_f32(row)) for row in data.advantages):
        rebuilt.append("advantages")
    verbatim = {name: value for name in SCORED_DATA_FIELDS
              if name not in ("tokens", "scores", "env_id") and name not in rebuilt
              and (value := getattr(data, name)) is not None}
    now = time.time()
    completions = tuple(
        Completion(
            completion_ids=tokens[i][start:].astype(np.int32),
            logprobs=logprobs[i],
            loss_mask=trainable[i][start:].astype(np.uint8),
            policy_version=policy_version,
            text=_last_assistant_text(data.messages[i]) if data.messages else "",
            info={ENV_SCORE: float(data.scores[i])},
        )
        for i in range(len(tokens))
    )
    try:
        return TrajectoryGroup(
            group_id=group_id, run=run, env=env, policy_version=policy_version,
            prompt_ids=tokens[0][:start].astype(np.int32), completions=completions,
            metadata={"atropos": {"env_id": data.env_id, "rebuilt": rebuilt,
                                  "posted": verbatim}},
            created_at=now, finished_at=now,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidGroup(f"invalid group: {exc}") from None


def to_scored(trajectory: TrajectoryGroup, data: ScoredData) -> ScoredGroup:
    """The group scored with the env's own scores (``--rewards env``)."""
    start = len(trajectory.prompt_ids)
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
    rebuilt = set(meta.get("rebuilt", ())) if own else set(_REBUILDABLE)
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
            _MASKED_LOGPROB).astype(np.float64))
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
