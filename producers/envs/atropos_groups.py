"""An Atropos group (``ScoredDataGroup``) as rollq sequences, field by field, exactly.

One mapping for both ways Atropos groups reach rollq: posted to the Atropos API
(``ops.atropos.convert``) and returned by an Atropos env run as a rollq env
(``producers.envs.atropos``). No atroposlib import: a group is a mapping with
``ScoredDataGroup``'s keys (``docs/guides/atropos.md`` lists the mapping).

- ``prompt_ids``: the longest prefix that is masked (-100) in every sequence and equal
  across them; each sequence's tokens after it are its ``completion_ids``.
- ``loss_mask``: 1 where ``masks`` is not -100 (Atropos masks are labels: the token id
  where trained, -100 elsewhere).
- ``logprobs``: ``inference_logprobs`` at trained tokens (float32), 0.0 elsewhere; when
  the env sent none, ``fallback`` (e.g. the server's own, matched by token) or all 0.0.
- each sequence's score: ``completions[i].info["env_score"]``.
- ``text``: the content of the last assistant message when ``messages`` are given.
- ``metadata["atropos"]``: ``env_id``, ``rebuilt`` (the per-token fields that rebuild
  exactly from the binary arrays) and ``posted`` (every other non-null field, verbatim),
  so the Atropos ``/batch`` gives the group back exactly as the env made it.
- An optional per-sequence field given as an empty list (atroposlib's default
  ``collect_trajectories`` sends ``advantages``, ``ref_logprobs``, ``overrides`` and
  ``images`` that way when no rollout set them) means "none".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rollq.schemas import Completion, ContractError

SCORED_DATA_FIELDS: tuple[str, ...] = (
    "tokens", "masks", "scores", "advantages", "ref_logprobs", "messages",
    "generation_params", "inference_logprobs", "overrides", "group_overrides", "images",
    "env_id", "distill_token_ids", "distill_logprobs")
"""Every key of atroposlib 0.4.0's ``ScoredData``, in its order."""
ENV_SCORE = "env_score"
"""Key of each completion's Atropos score in ``Completion.info`` (and component name)."""
MASKED = -100
MASKED_LOGPROB = 1.0  # atroposlib's value at untrained positions of inference_logprobs
MAX_TOKEN = 2**31 - 1
PER_SEQUENCE = ("masks", "scores", "advantages", "ref_logprobs", "messages",
                "inference_logprobs", "overrides", "distill_token_ids", "distill_logprobs")
REBUILDABLE = ("masks", "inference_logprobs", "advantages")

Fallback = Callable[[int, NDArray[np.int64], NDArray[np.bool_]], NDArray[np.float32] | None]
"""``fallback(i, tokens, trainable)``: logprobs of sequence ``i`` (one per token) when
the group has no ``inference_logprobs``, or None."""


class InvalidGroup(ContractError):
    """An Atropos group that is not self-consistent (lengths, non-finite values, ids)."""


@dataclass(frozen=True)
class AtroposSequences:
    """A group as rollq sequences: the shared prompt, the completions, the metadata."""

    prompt_ids: NDArray[np.int32]
    completions: tuple[Completion, ...]
    atropos: dict[str, Any]
    """``metadata["atropos"]``: ``env_id``, ``rebuilt``, ``posted``."""


def prompt_length(tokens: list[NDArray[np.int64]], masks: list[NDArray[np.int64]]) -> int:
    """Length of the longest prefix masked in every sequence and equal across them."""
    shortest = min(len(t) for t in tokens)
    if shortest == 0:
        return 0
    head = np.stack([t[:shortest] for t in tokens])
    masked = np.stack([m[:shortest] for m in masks]) == MASKED
    shared = masked.all(axis=0) & (head == head[0]).all(axis=0)
    return shortest if shared.all() else int(np.argmin(shared))


def check_group(data: Mapping[str, Any]) -> tuple[list[NDArray[np.int64]],
                                                  list[NDArray[np.int64]]]:
    """The group's tokens and masks as arrays; ``InvalidGroup`` when inconsistent."""
    count = len(data["tokens"])
    if count == 0:
        raise InvalidGroup("tokens is empty: a group needs at least one sequence")
    for name in PER_SEQUENCE:
        value = data.get(name)
        if name not in ("masks", "scores") and value == []:
            continue  # atroposlib's default collect_trajectories sends unused ones empty
        if value is not None and len(value) != count:
            raise InvalidGroup(f"{name} has {len(value)} entries for {count} sequences")
    tokens = [np.asarray(t, dtype=np.int64) for t in data["tokens"]]
    masks = [np.asarray(m, dtype=np.int64) for m in data["masks"]]
    for i, (t, m) in enumerate(zip(tokens, masks, strict=True)):
        if len(m) != len(t):
            raise InvalidGroup(f"masks[{i}] has {len(m)} values for {len(t)} tokens")
        if len(t) and (t.min() < 0 or t.max() > MAX_TOKEN):
            raise InvalidGroup(f"tokens[{i}] holds an id outside 0..{MAX_TOKEN}")
        if not ((m == MASKED) | ((m >= 0) & (m <= MAX_TOKEN))).all():
            raise InvalidGroup(f"masks[{i}] holds a value that is neither -100 nor a token "
                               f"id (0..{MAX_TOKEN})")
    for name in ("inference_logprobs", "advantages"):
        for i, row in enumerate(data.get(name) or ()):
            if len(row) != len(tokens[i]):
                raise InvalidGroup(f"{name}[{i}] has {len(row)} values for "
                                   f"{len(tokens[i])} tokens")
            if not np.isfinite(np.asarray(row, dtype=np.float64)).all():
                raise InvalidGroup(f"{name}[{i}] holds a non-finite value")
    if not np.isfinite(np.asarray(data["scores"], dtype=np.float64)).all():
        raise InvalidGroup("scores holds a non-finite value")
    return tokens, masks


def _last_assistant_text(conversation: list[dict[str, Any]]) -> str:
    for message in reversed(conversation):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


def atropos_sequences(data: Mapping[str, Any], *, policy_version: int,
                      fallback: Fallback | None = None,
                      info: Callable[[int], dict[str, Any]] | None = None) -> AtroposSequences:
    """The rollq sequences of an Atropos group (module docstring); ``info(i)`` adds to
    sequence ``i``'s ``Completion.info``. Raises ``InvalidGroup``."""
    tokens, masks = check_group(data)
    start = prompt_length(tokens, masks)
    rebuilt: list[str] = []
    trainable = [m != MASKED for m in masks]
    if all(np.array_equal(np.where(k, t, MASKED), m)
           for t, m, k in zip(tokens, masks, trainable, strict=True)):
        rebuilt.append("masks")
    logprobs: list[NDArray[np.float32]] = [np.zeros(len(t) - start, np.float32) for t in tokens]
    posted_logprobs = data.get("inference_logprobs")
    if posted_logprobs:
        exact = True
        for i, row in enumerate(posted_logprobs):
            posted = np.asarray(row, dtype=np.float64)
            as_f32 = np.where(trainable[i], posted, 0.0).astype(np.float32)
            logprobs[i] = as_f32[start:]
            again = np.where(trainable[i], as_f32.astype(np.float64), MASKED_LOGPROB)
            exact = exact and np.array_equal(again, posted)
        if exact:
            rebuilt.append("inference_logprobs")
    elif fallback is not None:
        for i in range(len(tokens)):
            found = fallback(i, tokens[i], trainable[i])
            if found is not None:
                logprobs[i] = np.where(trainable[i], found, 0.0).astype(np.float32)[start:]
    advantages = data.get("advantages")
    if advantages and all(
            np.array_equal(np.concatenate([np.zeros(start), np.asarray(row, np.float64)[start:]
                                           .astype(np.float32).astype(np.float64)]),
                           np.asarray(row, np.float64)) for row in advantages):
        rebuilt.append("advantages")
    verbatim = {name: value for name in SCORED_DATA_FIELDS
                if name not in ("tokens", "scores", "env_id") and name not in rebuilt
                and (value := data.get(name)) is not None}
    messages = data.get("messages")
    scores = data["scores"]
    try:
        completions = tuple(
            Completion(
                completion_ids=tokens[i][start:].astype(np.int32),
                logprobs=logprobs[i],
                loss_mask=trainable[i][start:].astype(np.uint8),
                policy_version=policy_version,
                text=_last_assistant_text(messages[i]) if messages else "",
                info={ENV_SCORE: float(scores[i]), **(info(i) if info is not None else {})},
            )
            for i in range(len(tokens))
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidGroup(f"invalid group: {exc}") from None
    return AtroposSequences(
        prompt_ids=tokens[0][:start].astype(np.int32), completions=completions,
        atropos={"env_id": data.get("env_id"), "rebuilt": rebuilt, "posted": verbatim})
