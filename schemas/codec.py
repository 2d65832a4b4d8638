"""The one codec: messages <-> stream entry fields.

A stream entry is a flat map of field name -> bytes. Identity fields are plain ASCII so that
``XRANGE`` is readable and any Redis client can route on them; token arrays are raw
little-endian bytes, concatenated over the group's completions with their lengths in
``lengths``; everything else is one orjson document in ``meta``. The README documents the
layout field by field.

``encode`` raises ``ContractError`` for metadata JSON cannot carry. ``decode`` raises
``DecodeError`` (``UnknownVersionError`` for a version it does not know)
and nothing else: the caller dead-letters the entry with the message as the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from schemas.errors import ContractError, DecodeError, UnknownVersionError
from schemas.models import (
    SCHEMA_VERSION,
    Completion,
    DeadLetter,
    Message,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
)

Fields = dict[bytes, bytes]

_I32, _F32, _U8 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<u1")
_DEAD_PAYLOAD_PREFIX = b"payload:"


def _pack(arrays: list[np.ndarray[Any, Any]], dtype: np.dtype[Any]) -> bytes:
    if not arrays:
        return b""
    return np.concatenate(arrays).astype(dtype, copy=False).tobytes()


def _encode_trajectory(group: TrajectoryGroup, kind: bytes) -> Fields:
    completions = group.completions
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
                "text": c.text,
                "reasoning": c.reasoning,
                "messages": c.messages,
                "turn_rewards": c.turn_rewards,
                "info": c.info,
            }
            for c in completions
        ],
    }
    fields: Fields = {
        b"v": str(SCHEMA_VERSION).encode(),
        b"kind": kind,
        b"group_id": group.group_id.encode(),
        b"run": group.run.encode(),
        b"env": group.env.encode(),
        b"policy_version": str(group.policy_version).encode(),
        b"meta": _dumps(meta),
        b"lengths": np.array([len(c.completion_ids) for c in completions], _I32).tobytes(),
        b"prompt_ids": group.prompt_ids.astype(_I32, copy=False).tobytes(),
        b"completion_ids": _pack([c.completion_ids for c in completions], _I32),
        b"logprobs": _pack([c.logprobs for c in completions], _F32),
        b"loss_mask": _pack([c.loss_mask for c in completions], _U8),
    }
    if any(c.token_versions is not None for c in completions):
        fields[b"token_versions"] = _pack([c.versions for c in completions], _I32)
    return fields


def encode(message: Message) -> Fields:
    """Encode a trajectory or scored group into stream entry fields."""
    if isinstance(message, TrajectoryGroup):
        return _encode_trajectory(message, b"traj")
    fields = _encode_trajectory(message.trajectory, b"scored")
    scores = message.scores
    fields[b"score_meta"] = _dumps(
        {
            "components": [s.components for s in scores],
            "weights": message.weights,
            "flags": message.flags,
            "reward_config": message.reward_config,
            "scored_at": message.scored_at,
        }
    )
    fields[b"rewards"] = np.array([s.reward for s in scores], _F32).tobytes()
    fields[b"advantages"] = np.array([s.advantage for s in scores], _F32).tobytes()
    fields[b"token_advantages"] = _pack([s.token_advantages for s in scores], _F32)
    if any(s.token_rewards is not None for s in scores):
        fields[b"token_rewards"] = _pack(
            [
                s.token_rewards
                if s.token_rewards is not None
                else np.zeros(len(s.token_advantages), np.float32)
                for s in scores
            ],
            _F32,
        )
    return fields


def _dumps(document: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as exc:
        raise ContractError(f"message metadata is not JSON-serialisable: {exc}") from None


def _field(fields: Mapping[bytes, bytes], name: bytes) -> bytes:
    try:
        return fields[name]
    except KeyError:
        raise DecodeError(f"missing field {name.decode()!r}") from None


def _array(fields: Mapping[bytes, bytes], name: bytes, dtype: np.dtype[Any], count: int) -> Any:
    raw = _field(fields, name)
    if len(raw) != count * dtype.itemsize:
        raise DecodeError(
            f"field {name.decode()!r} has {len(raw)} bytes, expected {count} x {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)


def _json(fields: Mapping[bytes, bytes], name: bytes) -> Any:
    try:
        return orjson.loads(_field(fields, name))
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"field {name.decode()!r} is not valid JSON: {exc}") from None


def _text(fields: Mapping[bytes, bytes], name: bytes) -> str:
    try:
        return _field(fields, name).decode()
    except UnicodeDecodeError:
        raise DecodeError(f"field {name.decode()!r} is not UTF-8") from None


def check_version(fields: Mapping[bytes, bytes]) -> None:
    """Raise unless the entry carries this code's schema version."""
    version = _field(fields, b"v")
    if version != str(SCHEMA_VERSION).encode():
        raise UnknownVersionError(
            f"unknown schema version {version[:16]!r} (this code reads v={SCHEMA_VERSION})"
        )


def _split(array: Any, lengths: np.ndarray[Any, Any]) -> list[Any]:
    return np.split(array, np.cumsum(lengths)[:-1]) if len(lengths) else []


def _decode_trajectory(fields: Mapping[bytes, bytes]) -> TrajectoryGroup:
    meta = _json(fields, b"meta")
    lengths_raw = _field(fields, b"lengths")
    if len(lengths_raw) % 4:
        raise DecodeError(f"field 'lengths' has {len(lengths_raw)} bytes, not a multiple of 4")
    lengths = np.frombuffer(lengths_raw, _I32)
    if (lengths < 0).any():
        raise DecodeError("field 'lengths' has a negative length")
    total = int(lengths.sum())
    prompt_raw = _field(fields, b"prompt_ids")
    if len(prompt_raw) % 4:
        raise DecodeError(f"field 'prompt_ids' has {len(prompt_raw)} bytes, not a multiple of 4")
    ids = _split(_array(fields, b"completion_ids", _I32, total), lengths)
    logprobs = _split(_array(fields, b"logprobs", _F32, total), lengths)
    masks = _split(_array(fields, b"loss_mask", _U8, total), lengths)
    versions: list[Any] = [None] * len(lengths)
    if b"token_versions" in fields:
        versions = _split(_array(fields, b"token_versions", _I32, total), lengths)
    try:
        per_completion = meta["completions"]
        if not isinstance(per_completion, list) or len(per_completion) != len(lengths):
            raise DecodeError(
                f"meta has {len(per_completion)} completions for {len(lengths)} lengths"
            )
        completions = tuple(
            Completion(
                completion_ids=ids[i],
                logprobs=logprobs[i],
                loss_mask=masks[i],
                token_versions=_if_changed(versions[i], per_completion[i]["policy_version"]),
                **per_completion[i],
            )
            for i in range(len(lengths))
        )
        return TrajectoryGroup(
            group_id=_text(fields, b"group_id"),
            run=_text(fields, b"run"),
            env=_text(fields, b"env"),
            policy_version=int(_field(fields, b"policy_version")),
            prompt_ids=np.frombuffer(prompt_raw, _I32),
            prompt_text=meta["prompt_text"],
            prompt_messages=meta["prompt_messages"],
            completions=completions,
            metadata=meta["metadata"],
            created_at=meta["created_at"],
            finished_at=meta["finished_at"],
        )
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        raise DecodeError(f"invalid trajectory group: {_short(exc)}") from None


def _decode_scored(fields: Mapping[bytes, bytes], trajectory: TrajectoryGroup) -> ScoredGroup:
    lengths = np.array([len(c.completion_ids) for c in trajectory.completions], np.int64)
    n, total = len(lengths), int(lengths.sum())
    meta = _json(fields, b"score_meta")
    rewards = _array(fields, b"rewards", _F32, n)
    advantages = _array(fields, b"advantages", _F32, n)
    token_advantages = _split(_array(fields, b"token_advantages", _F32, total), lengths)
    token_rewards: list[Any] = [None] * n
    if b"token_rewards" in fields:
        token_rewards = _split(_array(fields, b"token_rewards", _F32, total), lengths)
    try:
        components = meta["components"]
        if len(components) != n:
            raise DecodeError(f"score_meta has {len(components)} component maps for {n} sequences")
        scores = tuple(
            SequenceScore(
                reward=float(rewards[i]),
                advantage=float(advantages[i]),
                token_advantages=token_advantages[i],
                token_rewards=token_rewards[i],
                components=components[i],
            )
            for i in range(n)
        )
        return ScoredGroup(
            trajectory=trajectory,
            scores=scores,
            weights=meta["weights"],
            flags=meta["flags"],
            reward_config=meta["reward_config"],
            scored_at=meta["scored_at"],
        )
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        raise DecodeError(f"invalid scored group: {_short(exc)}") from None


def decode(fields: Mapping[bytes, bytes]) -> Message:
    """Decode stream entry fields into a ``TrajectoryGroup`` or ``ScoredGroup``.

    Arrays are zero-copy, read-only views of the entry's bytes.
    """
    check_version(fields)
    kind = _field(fields, b"kind")
    if kind not in (b"traj", b"scored"):
        raise DecodeError(f"unknown kind {kind[:16]!r}")
    trajectory = _decode_trajectory(fields)
    if kind == b"traj":
        return trajectory
    return _decode_scored(fields, trajectory)


def decode_trajectory(fields: Mapping[bytes, bytes]) -> TrajectoryGroup:
    """Decode an entry that must be a trajectory group."""
    message = decode(fields)
    if not isinstance(message, TrajectoryGroup):
        raise DecodeError(f"expected a trajectory group, got kind {message.kind!r}")
    return message


def decode_scored(fields: Mapping[bytes, bytes]) -> ScoredGroup:
    """Decode an entry that must be a scored group."""
    message = decode(fields)
    if not isinstance(message, ScoredGroup):
        raise DecodeError(f"expected a scored group, got kind {message.kind!r}")
    return message


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
            reason=_text(fields, b"reason"),
            detail=_text(fields, b"detail"),
            source_stream=_text(fields, b"source_stream"),
            source_id=_text(fields, b"source_id"),
            consumer_group=_text(fields, b"consumer_group"),
            deliveries=int(_field(fields, b"deliveries")),
            dead_at=float(_field(fields, b"dead_at")),
            payload={
                name[len(_DEAD_PAYLOAD_PREFIX) :]: value
                for name, value in fields.items()
                if name.startswith(_DEAD_PAYLOAD_PREFIX)
            },
        )
    except (ValidationError, ValueError) as exc:
        raise DecodeError(f"invalid dead letter: {_short(exc)}") from None


def _if_changed(versions: Any, policy_version: Any) -> Any:
    """Per-token versions only when they differ from the sequence's version (see model)."""
    if versions is None or (len(versions) and (versions != policy_version).any()):
        return versions
    return None


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."
