"""The one codec: messages <-> stream entry fields.

A stream entry is a flat map of field name -> bytes. Identity fields are plain ASCII so that
``XRANGE`` is readable and any Redis client can route on them; token arrays are raw
little-endian bytes, concatenated over the group's completions with their lengths in
``lengths``; everything else is one orjson document in ``meta``. The README documents the
layout field by field.

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

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from schemas.arrays import MAX_VERSION, broadcast, check_values, is_broadcast
from schemas.errors import ContractError, DecodeError, UnknownVersionError
from schemas.models import (
    SCHEMA_VERSION,
    Completion,
    DeadLetter,
    FiniteFloat,
    ScoredGroup,
    SequenceScore,
    StreamGroup,
    TrajectoryGroup,
    check_json,
    check_tokens,
)

Fields = dict[bytes, bytes]

_I32, _F32, _U8 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<u1")
_DEAD_PAYLOAD_PREFIX = b"payload:"
_VERSION_TEXT = re.compile(rb"[0-9]{1,10}")  # an ASCII int (no sign); [0, 2^31) has <= 10 digits


def _pack(arrays: list[np.ndarray[Any, Any]], dtype: np.dtype[Any]) -> bytes:
    # one copy: join reads each (contiguous, little-endian) array's buffer directly
    return b"".join(np.ascontiguousarray(a, dtype=dtype).data for a in arrays)


def _identity(group: TrajectoryGroup, kind: bytes) -> Fields:
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
            }
            for c in completions
        ],
    }
    lengths = np.array([len(c.completion_ids) for c in completions], _I32)
    fields = _identity(group, kind)
    fields.update({
        b"meta": _dumps(meta),
        b"texts": b"".join(texts),
        b"text_lengths": np.array([len(t) for t in texts], _I32).tobytes(),
        b"lengths": lengths.tobytes(),
        b"prompt_ids": group.prompt_ids.astype(_I32, copy=False).tobytes(),
        b"completion_ids": _pack([c.completion_ids for c in completions], _I32),
        b"logprobs": _pack([c.logprobs for c in completions], _F32),
        b"loss_mask": _pack([c.loss_mask for c in completions], _U8),
    })
    if any(c.token_versions is not None for c in completions):
        fields[b"token_versions"] = _pack([c.versions for c in completions], _I32)
    try:
        _check_identity_values(group.policy_version,
                               [c.policy_version for c in completions])
        _check_trajectory_values(fields, lengths.tolist(), None)
        _check_written("meta", fields[b"meta"], meta)
    except (DecodeError, ValueError, TypeError) as exc:
        raise ContractError(f"cannot encode group {group.group_id[:80]!r}: {exc}") from None
    return fields


_TRAJECTORY_FIELDS = frozenset({
    b"v", b"group_id", b"run", b"env", b"policy_version", b"meta", b"texts", b"text_lengths",
    b"lengths", b"prompt_ids", b"completion_ids", b"logprobs", b"loss_mask", b"token_versions"})
_IDENTITY_NAMES = ("group_id", "run", "env", "policy_version")
"""A group's identity fields: plain ASCII/UTF-8 in every group entry, traj and scored."""
_IDENTITY_FIELDS = tuple(name.encode() for name in _IDENTITY_NAMES)
TRAJECTORY_REF = b"traj"
"""Field of a reference-form scored entry: the id of its trajectory's traj entry."""


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
    trajectory: TrajectoryGroup, *, rewards: Sequence[float], advantages: Sequence[float],
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
    ``ContractError``.
    """
    if trajectory_id is not None:
        fields = _identity(trajectory, b"scored")
        fields[TRAJECTORY_REF] = trajectory_id.encode()
    else:
        fields = _encode_trajectory(trajectory, b"scored")
    score_meta = {
        "components": list(components),
        "weights": weights,
        "flags": flags,
        "reward_config": reward_config,
        "scored_at": scored_at,
    }
    lengths = [len(c.completion_ids) for c in trajectory.completions]
    try:
        fields[b"score_meta"] = _dumps(score_meta)
        rewards_array = np.array(rewards, _F32)
        fields[b"rewards"] = rewards_array.tobytes()
        advantages_array = np.array(advantages, _F32)
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
            fields[b"token_advantages"] = _pack(list(token_advantages), _F32)
        if token_rewards is not None and any(t is not None for t in token_rewards):
            fields[b"token_rewards"] = _pack(
                [t if t is not None else np.zeros(length, np.float32)
                 for t, length in zip(token_rewards, lengths, strict=True)], _F32)
        _check_written("score_meta", fields[b"score_meta"], score_meta)
        _check_score_values(fields, rewards_array, advantages_array, sum(lengths))
    except (DecodeError, ValueError, TypeError) as exc:
        raise ContractError(f"cannot encode the scores of group "
                            f"{trajectory.group_id[:80]!r}: {exc}") from None
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


def _check_identity_values(policy_version: int, completion_versions: list[int]) -> None:
    for version in (policy_version, *completion_versions):
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"policy_version {version} is outside [0, 2^31)")


def _values(name: bytes, array: Any, **bounds: float | None) -> None:
    """``check_values`` on a decoded field, raising DecodeError that names the field."""
    try:
        check_values(f"field {name.decode()!r}", array, **bounds)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def _check_trajectory_values(fields: Mapping[bytes, bytes], lengths: list[int],
                             vocab_size: int | None) -> Any:
    """Check a trajectory's arrays (sizes and values, whole group at once); returns
    (prompt ids, completion ids, logprobs, loss mask, token versions or None) as views."""
    if min(lengths, default=0) < 0:
        raise DecodeError("field 'lengths' has a negative length")
    if min(lengths, default=1) == 0:
        raise DecodeError("field 'lengths' has an empty completion: each has at least one "
                          "token")
    total = sum(lengths)
    prompt_ids = _whole_array(fields, b"prompt_ids", _I32)
    ids = _array(fields, b"completion_ids", _I32, total)
    logprobs = _array(fields, b"logprobs", _F32, total)
    masks = _array(fields, b"loss_mask", _U8, total)
    versions = None
    if b"token_versions" in fields:
        versions = _array(fields, b"token_versions", _I32, total)
    high = None if vocab_size is None else vocab_size - 1
    _values(b"prompt_ids", prompt_ids, low=0, high=high)
    try:
        check_tokens(completion_ids=ids, logprobs=logprobs, loss_mask=masks,
                     token_versions=versions, vocab_size=vocab_size, label="field '{}'")
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    return prompt_ids, ids, logprobs, masks, versions


def _check_score_values(fields: Mapping[bytes, bytes], rewards: Any, advantages: Any,
                        total: int) -> tuple[Any, Any]:
    """Check a scored entry's arrays; returns (token advantages, token rewards), each the
    whole group's array or None when absent."""
    _values(b"rewards", rewards)
    _values(b"advantages", advantages)
    token_advantages = token_rewards = None
    if b"token_advantages" in fields:
        token_advantages = _array(fields, b"token_advantages", _F32, total)
        _values(b"token_advantages", token_advantages)
    if b"token_rewards" in fields:
        token_rewards = _array(fields, b"token_rewards", _F32, total)
        _values(b"token_rewards", token_rewards)
    return token_advantages, token_rewards


def _array(fields: Mapping[bytes, bytes], name: bytes, dtype: np.dtype[Any], count: int) -> Any:
    raw = _field(fields, name)
    if len(raw) != count * dtype.itemsize:
        raise DecodeError(
            f"field {name.decode()!r} has {len(raw)} bytes, expected {count} x {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)


def _whole_array(fields: Mapping[bytes, bytes], name: bytes, dtype: np.dtype[Any]) -> Any:
    """A field of any count of ``dtype`` values (its byte length a multiple of their size)."""
    raw = _field(fields, name)
    if len(raw) % dtype.itemsize:
        raise DecodeError(f"field {name.decode()!r} has {len(raw)} bytes, not a multiple of "
                          f"{dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype)


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


def _split(array: Any, offsets: list[int]) -> list[Any]:
    # plain slicing: np.split costs ~50 µs a call, a slice ~0.2 µs
    return [array[start:stop] for start, stop in itertools.pairwise(offsets)]


def _meta_model(model: type[BaseModel], exclude: set[str], name: str,
                **extra: Any) -> Any:
    """A TypedDict of ``model``'s JSON-carried fields, with the same types and constraints
    (validation returns plain dicts, cheaper to attach than model instances)."""
    fields: dict[str, Any] = {
        field: Annotated[info.annotation, info]
        for field, info in model.model_fields.items() if field not in exclude
    }
    fields.update(extra)
    typed = TypedDict(name, fields)
    typed.__pydantic_config__ = ConfigDict(  # type: ignore[attr-defined]
        extra="forbid", allow_inf_nan=False)
    return typed


# The JSON documents in ``meta`` and ``score_meta``, and the identity fields, are validated
# against the models' own field types in one pydantic-core pass each; the arrays are typed
# and sized by construction. The models are then assembled from those values without a
# second validation (``from_valid``).
_CompletionMeta = _meta_model(
    Completion, {"completion_ids", "logprobs", "loss_mask", "token_versions", "text"},
    "CompletionMeta")
_TrajectoryMeta = _meta_model(
    TrajectoryGroup,
    {"v", "kind", "group_id", "run", "env", "policy_version", "prompt_ids", "completions"},
    "TrajectoryMeta", completions=list[_CompletionMeta])  # type: ignore[valid-type]  # built at import
_ScoreMeta = _meta_model(
    ScoredGroup, {"v", "kind", "trajectory", "scores"}, "ScoreMeta",
    components=list[dict[str, FiniteFloat | None]])
_Identity = _meta_model(TrajectoryGroup,
                        set(TrajectoryGroup.model_fields) - set(_IDENTITY_NAMES), "Identity")
_TRAJECTORY_META = TypeAdapter(_TrajectoryMeta)
_SCORE_META = TypeAdapter(_ScoreMeta)
_IDENTITY = TypeAdapter(_Identity)


def _validated(adapter: TypeAdapter[Any], fields: Mapping[bytes, bytes], name: bytes) -> Any:
    # orjson parses strict JSON: NaN, Infinity and numbers that overflow a double (1e999)
    # are errors, in free-form fields (metadata, info…) too, which pydantic's own parser
    # would read as floats. Costs ~8 µs for a 16-completion group's meta over validate_json.
    try:
        return adapter.validate_python(orjson.loads(_field(fields, name)))
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"field {name.decode()!r} is invalid JSON: {_short(exc)}") from None
    except ValidationError as exc:
        raise DecodeError(f"field {name.decode()!r} is invalid: {_short(exc)}") from None


def _offsets(lengths: list[int]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))  # ~3x np.cumsum for a group


def _texts(fields: Mapping[bytes, bytes], count: int) -> list[str]:
    """The completion texts: ``texts`` cut at the UTF-8 byte lengths in ``text_lengths``."""
    raw = _field(fields, b"texts")
    lengths = _array(fields, b"text_lengths", _I32, count).tolist()
    if min(lengths, default=0) < 0 or sum(lengths) != len(raw):
        raise DecodeError(f"field 'text_lengths' does not cut the {len(raw)} bytes of 'texts'")
    view = memoryview(raw)  # decode each text straight from the entry's bytes
    try:
        return [str(view[a:b], "utf-8") for a, b in itertools.pairwise(_offsets(lengths))]
    except UnicodeDecodeError:
        raise DecodeError("field 'texts' is not UTF-8") from None


def _decode_trajectory(fields: Mapping[bytes, bytes], run: str | None,
                       vocab_size: int | None) -> TrajectoryGroup:
    lengths = _whole_array(fields, b"lengths", _I32).tolist()
    prompt_ids, all_ids, all_logprobs, all_masks, all_versions = _check_trajectory_values(
        fields, lengths, vocab_size)
    offsets = _offsets(lengths)
    ids = _split(all_ids, offsets)
    logprobs = _split(all_logprobs, offsets)
    masks = _split(all_masks, offsets)
    versions: list[Any] = [None] * len(lengths)
    if all_versions is not None:
        versions = _split(all_versions, offsets)
    texts = _texts(fields, len(lengths))
    meta = _validated(_TRAJECTORY_META, fields, b"meta")
    if len(meta["completions"]) != len(lengths):
        raise DecodeError(f"meta has {len(meta['completions'])} completions for "
                          f"{len(lengths)} lengths")
    completions = tuple(
        Completion.from_valid({
            "completion_ids": ids[i], "logprobs": logprobs[i], "loss_mask": masks[i],
            "token_versions": _if_changed(versions[i], info["policy_version"]),
            "text": texts[i], **info})
        for i, info in enumerate(meta["completions"])
    )
    if not completions:
        raise DecodeError("invalid trajectory group: it has no completions")
    try:
        version = _field(fields, b"policy_version")
        if not _VERSION_TEXT.fullmatch(version):
            raise ValueError(f"field 'policy_version' is {version[:24]!r}, not a decimal "
                             "integer in [0, 2^31)")
        identity = _IDENTITY.validate_python({
            "group_id": _text(fields, b"group_id"),
            "run": _text(fields, b"run"),
            "env": _text(fields, b"env"),
            "policy_version": int(version),
        })
    except (ValidationError, ValueError) as exc:
        raise DecodeError(f"invalid trajectory group: {_short(exc)}") from None
    if run is not None and identity["run"] != run:
        raise DecodeError(f"field 'run' is {identity['run'][:80]!r}, but the entry is in a "
                          f"stream of run {run!r}")
    del meta["completions"]
    return TrajectoryGroup.from_valid({
        "v": SCHEMA_VERSION, "kind": "traj", **identity,
        "prompt_ids": prompt_ids, "completions": completions, **meta})


def _decode_scored(fields: Mapping[bytes, bytes], trajectory: TrajectoryGroup) -> ScoredGroup:
    lengths = [len(c.completion_ids) for c in trajectory.completions]
    offsets = _offsets(lengths)
    n, total = len(lengths), offsets[-1]
    rewards = _array(fields, b"rewards", _F32, n)
    advantages = _array(fields, b"advantages", _F32, n)
    all_advantages, all_rewards = _check_score_values(fields, rewards, advantages, total)
    if all_advantages is not None:
        token_advantages = _split(all_advantages, offsets)
    else:
        token_advantages = broadcast(advantages, lengths)
    token_rewards: list[Any] = [None] * n
    if all_rewards is not None:
        token_rewards = _split(all_rewards, offsets)
    meta = _validated(_SCORE_META, fields, b"score_meta")
    if len(meta["components"]) != n:
        raise DecodeError(f"score_meta has {len(meta['components'])} component maps for "
                          f"{n} sequences")
    scores = tuple(
        SequenceScore.from_valid({
            "reward": float(rewards[i]), "advantage": float(advantages[i]),
            "token_advantages": token_advantages[i], "components": meta["components"][i],
            "token_rewards": token_rewards[i]})
        for i in range(n)
    )
    del meta["components"]
    return ScoredGroup.from_valid({
        "v": SCHEMA_VERSION, "kind": "scored", "trajectory": trajectory, "scores": scores, **meta})


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
    for name in _IDENTITY_FIELDS:
        if trajectory.get(name) != scored.get(name):
            raise DecodeError(
                f"traj entry {_field(scored, TRAJECTORY_REF)[:40]!r} does not hold this group: "
                f"{name.decode()} {trajectory.get(name, b'')[:40]!r} != "
                f"{scored.get(name, b'')[:40]!r}")
    fields = {k: v for k, v in trajectory.items() if k in _TRAJECTORY_FIELDS}
    fields.update((k, v) for k, v in scored.items() if k != TRAJECTORY_REF)
    return fields


def decode(fields: Mapping[bytes, bytes], *, run: str | None = None,
           vocab_size: int | None = None) -> StreamGroup:
    """Decode stream entry fields into a ``TrajectoryGroup`` or ``ScoredGroup`` (a scored
    entry in its inline form: see ``join_trajectory``).

    Arrays are zero-copy, read-only views of the entry's bytes. ``run``: the run of the
    stream the entry was read from (the key says it), which the entry's ``run`` must be.
    ``vocab_size``: the model's vocabulary size, which every token id must be below.
    """
    check_version(fields)
    kind = _field(fields, b"kind")
    if kind not in (b"traj", b"scored"):
        raise DecodeError(f"unknown kind {kind[:16]!r}")
    if kind == b"scored" and TRAJECTORY_REF in fields:
        raise DecodeError(
            f"scored entry names traj entry {fields[TRAJECTORY_REF][:40]!r}: join it first "
            "(schemas.join_trajectory)")
    trajectory = _decode_trajectory(fields, run, vocab_size)
    if kind == b"traj":
        return trajectory
    return _decode_scored(fields, trajectory)


def decode_trajectory(fields: Mapping[bytes, bytes], *, run: str | None = None,
                      vocab_size: int | None = None) -> TrajectoryGroup:
    """Decode an entry that must be a trajectory group (``decode``'s checks)."""
    message = decode(fields, run=run, vocab_size=vocab_size)
    if not isinstance(message, TrajectoryGroup):
        raise DecodeError(f"expected a trajectory group, got kind {message.kind!r}")
    return message


def decode_scored(fields: Mapping[bytes, bytes], *, run: str | None = None,
                  vocab_size: int | None = None) -> ScoredGroup:
    """Decode an entry that must be a scored group (``decode``'s checks)."""
    message = decode(fields, run=run, vocab_size=vocab_size)
    if not isinstance(message, ScoredGroup):
        raise DecodeError(f"expected a scored group, got kind {message.kind!r}")
    return message


def scored_rewards(fields: Mapping[bytes, bytes]) -> list[float]:
    """The sequence rewards of a scored entry, either form, without decoding the rest."""
    check_version(fields)
    rewards = _whole_array(fields, b"rewards", _F32)
    if not np.isfinite(rewards).all():
        raise DecodeError("rewards are not finite")
    return [float(r) for r in rewards]


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
