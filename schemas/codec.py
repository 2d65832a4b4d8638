"""The one codec: messages <-> stream entry fields.

A stream entry is a flat map of field name -> bytes. Identity fields are plain ASCII so that
``XRANGE`` is readable and any Redis client can route on them; token arrays are raw
little-endian bytes, concatenated over the group's completions with their lengths in
``lengths``; everything else is one orjson document in ``meta``.
docs/reference/wire-format.md documents the layout field by field.

A scored entry comes in two forms. The scorer's forward writes the *reference* form: the
group's identity, its scores, and in ``traj`` the id of the trajectory's entry in the same
partition's traj stream, so a group's token arrays are written to Redis once, not once per
hop. ``join_trajectory`` merges that traj entry in, giving the *inline* form (every
trajectory field beside the scores), which is what ``decode`` reads; rescore, which writes
into another run, writes the inline form directly.

Values are checked in both directions, not only shapes (the rules are in
``schemas.models``: ids >= 0, logprobs finite and <= 0, masks 0/1, versions in [0, 2^31),
no empty completion, finite rewards/advantages/per-token values, metadata without NaN,
infinities or integers beyond 64 bits). The arrays are checked once per group, over the
concatenated bytes, with vectorised reductions (a few µs per field for 32K tokens, never a
Python loop over elements). JSON is parsed strictly on decode (orjson: NaN, Infinity and
numbers that overflow a double are errors, free-form metadata included), then typed by
pydantic; on encode, where orjson would silently write NaN as null, the written JSON is
read back and compared. ``decode`` also takes what only a reader knows: the ``run`` of the
stream it read (an entry of another run is invalid there) and the model's ``vocab_size``.

``encode`` raises ``ContractError`` for values the contract forbids or JSON cannot carry.
``decode`` raises ``DecodeError`` (``UnknownVersionError`` for a version it does not know),
naming the field, and nothing else: the caller dead-letters the entry (reason via
``schemas.failures.classify``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from rollq.schemas.arrays import is_broadcast
from rollq.schemas.columns import TrajectoryColumns
from rollq.schemas.decoding import decode, decode_scored, decode_trajectory, scored_rewards
from rollq.schemas.entry import (
    F32,
    I32,
    IDENTITY_FIELDS,
    TRAJECTORY_FIELDS,
    TRAJECTORY_REF,
    U8,
    Fields,
    check_identity_values,
    check_score_values,
    check_trajectory_values,
    check_version,
    field_bytes,
    field_text,
    short_error,
)
from rollq.schemas.errors import ContractError, DecodeError
from rollq.schemas.models import (
    SCHEMA_VERSION,
    DeadLetter,
    StreamGroup,
    TrajectoryGroup,
    check_json,
    check_routed_positions,
)

__all__ = [
    "TRAJECTORY_REF", "Fields", "decode", "decode_dead", "decode_scored", "decode_trajectory",
    "encode", "encode_dead", "encode_scores", "join_trajectory", "scored_rewards",
    "trajectory_ref",
]
"""The codec's public names; the decode side lives in ``schemas.decoding``."""


_DEAD_PAYLOAD_PREFIX = b"payload:"


def _pack(arrays: list[np.ndarray[Any, Any]], dtype: np.dtype[Any]) -> bytes:
    # one copy: join reads each (contiguous, little-endian) array's buffer directly
    return b"".join(np.ascontiguousarray(a, dtype=dtype).data for a in arrays)


def _identity(group: TrajectoryGroup | TrajectoryColumns, kind: bytes) -> Fields:
    """The fields every group entry starts with: version, kind and the group's identity."""
    return {
        b"v": str(SCHEMA_VERSION).encode(),
        b"kind": kind,
        b"group_id": group.group_id.encode(),
        b"run": group.run.encode(),
        b"env": group.env.encode(),
        b"policy_version": str(group.policy_version).encode(),
    }


def _encode_trajectory(group: TrajectoryGroup, kind: bytes) -> Fields:
    """The fields of a group's trajectory; raises ``ContractError`` for a value the
    contract forbids (a model built without validation: ``model_construct``,
    ``model_copy(update=...)``)."""
    completions = group.completions
    # Completion texts are bulk (a quarter of a long group's bytes): raw UTF-8 beside the
    # token arrays, not JSON strings that every reader would scan for escapes.
    texts = [c.text.encode() for c in completions]
    meta = {
        "prompt_text": group.prompt_text,
        "prompt_messages": group.prompt_messages,
        "metadata": group.metadata,
        "created_at": group.created_at,
        "finished_at": group.finished_at,
        "completions": [
            {
                "policy_version": c.policy_version,
                "finish_reason": c.finish_reason,
                "reasoning": c.reasoning,
                "messages": c.messages,
                "turn_rewards": c.turn_rewards,
                "info": c.info,
                "sampling": None if c.sampling is None else c.sampling.model_dump(),
                "routed_experts": None if c.routed_experts is None else {
                    "dtype": c.routed_experts.dtype.name,
                    "shape": list(c.routed_experts.shape)},
            }
            for c in completions
        ],
    }
    lengths = np.array([len(c.completion_ids) for c in completions], I32)
    fields = _identity(group, kind)
    fields.update({
        b"meta": _dumps(meta),
        b"texts": b"".join(texts),
        b"text_lengths": np.array([len(t) for t in texts], I32).tobytes(),
        b"lengths": lengths.tobytes(),
        b"prompt_ids": group.prompt_ids.astype(I32, copy=False).tobytes(),
        b"completion_ids": _pack([c.completion_ids for c in completions], I32),
        b"logprobs": _pack([c.logprobs for c in completions], F32),
        b"loss_mask": _pack([c.loss_mask for c in completions], U8),
    })
    if any(c.token_versions is not None for c in completions):
        fields[b"token_versions"] = _pack([c.versions for c in completions], I32)
    routed = [c.routed_experts for c in completions if c.routed_experts is not None]
    if routed:  # each in its own dtype, in completion order; meta says dtype and shape
        fields[b"routed_experts"] = b"".join(np.ascontiguousarray(a).data for a in routed)
    try:
        check_identity_values(group.policy_version,
                               [c.policy_version for c in completions])
        check_trajectory_values(fields, lengths.tolist(), None)
        check_routed_positions(len(group.prompt_ids), lengths.tolist(),
                               [c.routed_experts for c in completions])
        _check_written("meta", fields[b"meta"], meta)
    except (DecodeError, ValueError, TypeError) as exc:
        raise ContractError(f"cannot encode group {group.group_id[:80]!r}: {exc}") from None
    return fields


def encode(message: StreamGroup, *, trajectory_id: str | None = None) -> Fields:
    """Encode a trajectory or scored group into stream entry fields.

    For a scored group, ``trajectory_id`` (the id of the traj entry it was decoded from)
    gives the reference form: identity and scores only, the trajectory named in ``traj``.
    Without it, the inline form carries every trajectory field too.
    """
    if isinstance(message, TrajectoryGroup):
        return _encode_trajectory(message, b"traj")
    scores = message.scores
    return encode_scores(
        message.trajectory,
        rewards=[s.reward for s in scores],
        advantages=[s.advantage for s in scores],
        token_advantages=[s.token_advantages for s in scores],
        token_rewards=[s.token_rewards for s in scores],
        components=[s.components for s in scores],
        weights=message.weights, flags=message.flags, reward_config=message.reward_config,
        scored_at=message.scored_at, trajectory_id=trajectory_id)


def encode_scores(
    trajectory: TrajectoryGroup | TrajectoryColumns, *, rewards: Sequence[float],
    advantages: Sequence[float],
    token_advantages: Sequence[np.ndarray[Any, Any]],
    token_rewards: Sequence[np.ndarray[Any, Any] | None] | None,
    components: Sequence[Mapping[str, float | None]], weights: Mapping[str, float],
    flags: Sequence[str], reward_config: str, scored_at: float,
    trajectory_id: str | None = None,
) -> Fields:
    """The entry fields of ``trajectory`` scored: what ``encode`` writes for the
    ``ScoredGroup`` of these values (per sequence: reward, advantage, per-token advantages,
    per-token rewards or None, component values), without building one.

    A scorer writes its results straight into the wire form this way; every value is
    checked as ``encode`` checks it (finite numbers, one score and one token value per
    token of each completion, JSON that carries what it was given), raising
    ``ContractError``. ``trajectory`` may be the decoded columns of its entry
    (``schemas.columns``): the reference form needs no models.
    """
    if isinstance(trajectory, TrajectoryColumns):
        lengths = trajectory.lengths
    else:
        lengths = [len(c.completion_ids) for c in trajectory.completions]
    if trajectory_id is not None:
        fields = _identity(trajectory, b"scored")
        fields[TRAJECTORY_REF] = trajectory_id.encode()
    else:
        group = trajectory.group() if isinstance(trajectory, TrajectoryColumns) else trajectory
        fields = _encode_trajectory(group, b"scored")
    score_meta = {
        "components": list(components),
        "weights": weights,
        "flags": flags,
        "reward_config": reward_config,
        "scored_at": scored_at,
    }
    try:
        fields[b"score_meta"] = _dumps(score_meta)
        rewards_array = np.array(rewards, F32)
        fields[b"rewards"] = rewards_array.tobytes()
        advantages_array = np.array(advantages, F32)
        fields[b"advantages"] = advantages_array.tobytes()
        counts = {len(rewards), len(advantages), len(token_advantages), len(components)}
        if token_rewards is not None:
            counts.add(len(token_rewards))
        if len(rewards) != len(lengths):
            raise ValueError(f"{len(rewards)} scores for {len(lengths)} completions")
        if counts != {len(lengths)}:
            raise ValueError(f"per-sequence values for {sorted(counts)} sequences, "
                             f"{len(lengths)} completions")
        for name, arrays in (("token_advantages", token_advantages),
                             ("token_rewards", token_rewards)):
            # counts already checked equal; token_rewards may be None (none at all)
            for index, (array, length) in enumerate(zip(arrays or (), lengths, strict=False)):
                if array is not None and len(array) != length:
                    raise ValueError(f"scores[{index}].{name} has {len(array)} values for "
                                     f"{length} tokens")
        # Per-token advantages travel only when they are not the sequence advantage
        # broadcast (process rewards): for plain GRPO they would add a third to the entry
        # for nothing.
        if not all(is_broadcast(np.asarray(t), a)
                   for t, a in zip(token_advantages, advantages_array, strict=True)):
            fields[b"token_advantages"] = _pack(list(token_advantages), F32)
        if token_rewards is not None and any(t is not None for t in token_rewards):
            fields[b"token_rewards"] = _pack(
                [t if t is not None else np.zeros(length, np.float32)
                 for t, length in zip(token_rewards, lengths, strict=True)], F32)
        _check_written("score_meta", fields[b"score_meta"], score_meta)
        check_score_values(fields, rewards_array, advantages_array, sum(lengths))
    except (DecodeError, ValueError, TypeError) as exc:
        raise ContractError(f"cannot encode the scores of group "
                            f"{trajectory.group_id[:80]!r}: {exc}") from None
    return fields


def _dumps(document: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as exc:
        raise ContractError(f"message metadata is not JSON-serialisable: {exc}") from None


def _check_written(name: str, raw: bytes, document: dict[str, Any]) -> None:
    """Raise ValueError when ``document`` held a number JSON cannot carry. orjson writes
    NaN and infinities as null, so the document read back differs: only then is it walked
    to name the value (a read-back compare costs about half the walk)."""
    try:
        if orjson.loads(raw) == document:
            return
    except ValueError:  # a numpy array in free-form metadata: equality is ambiguous
        pass
    check_json(name, document)


def trajectory_ref(fields: Mapping[bytes, bytes]) -> str | None:
    """The traj entry id a reference-form scored entry names; None for any other entry."""
    ref = fields.get(TRAJECTORY_REF)
    if ref is None or fields.get(b"kind") != b"scored":
        return None
    return ref.decode(errors="replace")


def join_trajectory(scored: Mapping[bytes, bytes], trajectory: Mapping[bytes, bytes]) -> Fields:
    """The inline form of a reference-form scored entry, given the traj entry it names.

    Raises ``DecodeError`` when that entry is not the same group's trajectory.
    """
    for name in IDENTITY_FIELDS:
        if trajectory.get(name) != scored.get(name):
            raise DecodeError(
                f"traj entry {field_bytes(scored, TRAJECTORY_REF)[:40]!r} does not hold this "
                f"group: {name.decode()} {trajectory.get(name, b'')[:40]!r} != "
                f"{scored.get(name, b'')[:40]!r}")
    fields = {k: v for k, v in trajectory.items() if k in TRAJECTORY_FIELDS}
    fields.update((k, v) for k, v in scored.items() if k != TRAJECTORY_REF)
    return fields


def encode_dead(letter: DeadLetter) -> Fields:
    """Encode a dead letter; the original fields are kept under ``payload:<name>``."""
    fields: Fields = {
        b"v": str(SCHEMA_VERSION).encode(),
        b"kind": b"dead",
        b"reason": letter.reason.encode(),
        b"detail": letter.detail.encode(),
        b"source_stream": letter.source_stream.encode(),
        b"source_id": letter.source_id.encode(),
        b"consumer_group": letter.consumer_group.encode(),
        b"deliveries": str(letter.deliveries).encode(),
        b"dead_at": repr(letter.dead_at).encode(),
    }
    for name, value in letter.payload.items():
        fields[_DEAD_PAYLOAD_PREFIX + name] = value
    return fields


def decode_dead(fields: Mapping[bytes, bytes]) -> DeadLetter:
    """Decode a dead-letter entry."""
    check_version(fields)
    try:
        return DeadLetter(
            reason=field_text(fields, b"reason"),
            detail=field_text(fields, b"detail"),
            source_stream=field_text(fields, b"source_stream"),
            source_id=field_text(fields, b"source_id"),
            consumer_group=field_text(fields, b"consumer_group"),
            deliveries=int(field_bytes(fields, b"deliveries")),
            dead_at=float(field_bytes(fields, b"dead_at")),
            payload={
                name[len(_DEAD_PAYLOAD_PREFIX) :]: value
                for name, value in fields.items()
                if name.startswith(_DEAD_PAYLOAD_PREFIX)
            },
        )
    except (ValidationError, ValueError) as exc:
        raise DecodeError(f"invalid dead letter: {short_error(exc)}") from None
