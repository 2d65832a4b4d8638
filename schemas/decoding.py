"""The codec's decode side: stream entry fields -> ``TrajectoryGroup`` / ``ScoredGroup``,
every value checked (``schemas.codec`` says what the contract is; ``schemas.entry`` reads
and checks the raw fields).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from rollq.schemas.columns import ScoredColumns, TrajectoryColumns
from rollq.schemas.entry import (
    F32,
    I32,
    IDENTITY_NAMES,
    TRAJECTORY_REF,
    check_score_values,
    check_trajectory_values,
    check_version,
    completion_texts,
    field_bytes,
    field_text,
    offsets_of,
    routed_arrays,
    short_error,
    sized_array,
    whole_array,
)
from rollq.schemas.errors import DecodeError
from rollq.schemas.models import (
    Completion,
    FiniteFloat,
    ScoredGroup,
    StreamGroup,
    TrajectoryGroup,
)

_VERSION_TEXT = re.compile(rb"[0-9]{1,10}")  # an ASCII int (no sign); [0, 2^31) has <= 10 digits


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
class _RoutedLayout(TypedDict):
    dtype: Literal["uint8", "uint16", "int32"]
    shape: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)],
                 Annotated[int, Field(ge=1)]]


_CompletionMeta = _meta_model(
    Completion,
    {"completion_ids", "logprobs", "loss_mask", "token_versions", "text", "routed_experts"},
    "CompletionMeta",
    routed_experts=Annotated[_RoutedLayout | None, Field(default=None)])
_TrajectoryMeta = _meta_model(
    TrajectoryGroup,
    {"v", "kind", "group_id", "run", "env", "policy_version", "prompt_ids", "completions"},
    "TrajectoryMeta", completions=list[_CompletionMeta])  # type: ignore[valid-type]  # built at import
_ScoreMeta = _meta_model(
    ScoredGroup, {"v", "kind", "trajectory", "scores"}, "ScoreMeta",
    components=list[dict[str, FiniteFloat | None]])
_Identity = _meta_model(TrajectoryGroup,
                        set(TrajectoryGroup.model_fields) - set(IDENTITY_NAMES), "Identity")
_TRAJECTORY_META = TypeAdapter(_TrajectoryMeta)
_SCORE_META = TypeAdapter(_ScoreMeta)
_IDENTITY = TypeAdapter(_Identity)


def _validated(adapter: TypeAdapter[Any], fields: Mapping[bytes, bytes], name: bytes) -> Any:
    # orjson parses strict JSON: NaN, Infinity and numbers that overflow a double (1e999)
    # are errors, in free-form fields (metadata, info…) too, which pydantic's own parser
    # would read as floats. Costs ~8 µs for a 16-completion group's meta over validate_json.
    try:
        return adapter.validate_python(orjson.loads(field_bytes(fields, name)))
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"field {name.decode()!r} is invalid JSON: {short_error(exc)}") from None
    except ValidationError as exc:
        raise DecodeError(f"field {name.decode()!r} is invalid: {short_error(exc)}") from None


def _trajectory_columns(fields: Mapping[bytes, bytes], run: str | None,
                        vocab_size: int | None) -> TrajectoryColumns:
    lengths = whole_array(fields, b"lengths", I32).tolist()
    prompt_ids, all_ids, all_logprobs, all_masks, all_versions = check_trajectory_values(
        fields, lengths, vocab_size)
    texts = completion_texts(fields, len(lengths))
    meta = _validated(_TRAJECTORY_META, fields, b"meta")
    if len(meta["completions"]) != len(lengths):
        raise DecodeError(f"meta has {len(meta['completions'])} completions for "
                          f"{len(lengths)} lengths")
    if not lengths:
        raise DecodeError("invalid trajectory group: it has no completions")
    try:
        version = field_bytes(fields, b"policy_version")
        if not _VERSION_TEXT.fullmatch(version):
            raise ValueError(f"field 'policy_version' is {version[:24]!r}, not a decimal "
                             "integer in [0, 2^31)")
        identity = _IDENTITY.validate_python({
            "group_id": field_text(fields, b"group_id"),
            "run": field_text(fields, b"run"),
            "env": field_text(fields, b"env"),
            "policy_version": int(version),
        })
    except (ValidationError, ValueError) as exc:
        raise DecodeError(f"invalid trajectory group: {short_error(exc)}") from None
    if run is not None and identity["run"] != run:
        raise DecodeError(f"field 'run' is {identity['run'][:80]!r}, but the entry is in a "
                          f"stream of run {run!r}")
    routed = routed_arrays(fields, [info["routed_experts"] for info in meta["completions"]],
                           len(prompt_ids), lengths)
    return TrajectoryColumns(
        identity=identity, prompt_ids=prompt_ids, lengths=lengths, offsets=offsets_of(lengths),
        completion_ids=all_ids, logprobs=all_logprobs, loss_mask=all_masks,
        token_versions=all_versions, texts=texts, meta=meta, routed_experts=routed)


def _scored_columns(fields: Mapping[bytes, bytes],
                    trajectory: TrajectoryColumns) -> ScoredColumns:
    n, total = len(trajectory.lengths), trajectory.offsets[-1]
    rewards = sized_array(fields, b"rewards", F32, n)
    advantages = sized_array(fields, b"advantages", F32, n)
    all_advantages, all_rewards = check_score_values(fields, rewards, advantages, total)
    meta = _validated(_SCORE_META, fields, b"score_meta")
    if len(meta["components"]) != n:
        raise DecodeError(f"score_meta has {len(meta['components'])} component maps for "
                          f"{n} sequences")
    return ScoredColumns(trajectory=trajectory, rewards=rewards, advantages=advantages,
                         token_advantages=all_advantages, token_rewards=all_rewards,
                         score_meta=meta)


def decode_columns(fields: Mapping[bytes, bytes], *, run: str | None = None,
                   vocab_size: int | None = None) -> TrajectoryColumns | ScoredColumns:
    """Every check of ``decode``, without assembling the models: the entry's values as
    ``TrajectoryColumns`` or ``ScoredColumns``, whose ``group()`` is what ``decode``
    returns (``schemas.columns``)."""
    check_version(fields)
    kind = field_bytes(fields, b"kind")
    if kind not in (b"traj", b"scored"):
        raise DecodeError(f"unknown kind {kind[:16]!r}")
    if kind == b"scored" and TRAJECTORY_REF in fields:
        raise DecodeError(
            f"scored entry names traj entry {fields[TRAJECTORY_REF][:40]!r}: join it first "
            "(schemas.join_trajectory)")
    trajectory = _trajectory_columns(fields, run, vocab_size)
    if kind == b"traj":
        return trajectory
    return _scored_columns(fields, trajectory)


def decode(fields: Mapping[bytes, bytes], *, run: str | None = None,
           vocab_size: int | None = None) -> StreamGroup:
    """Decode stream entry fields into a ``TrajectoryGroup`` or ``ScoredGroup`` (a scored
    entry in its inline form: see ``join_trajectory``).

    Arrays are zero-copy, read-only views of the entry's bytes. ``run``: the run of the
    stream the entry was read from (the key says it), which the entry's ``run`` must be.
    ``vocab_size``: the model's vocabulary size, which every token id must be below.
    """
    return decode_columns(fields, run=run, vocab_size=vocab_size).group()


def decode_trajectory_columns(fields: Mapping[bytes, bytes], *, run: str | None = None,
                              vocab_size: int | None = None) -> TrajectoryColumns:
    """``decode_trajectory``'s checks, the values left unassembled (``TrajectoryColumns``)."""
    columns = decode_columns(fields, run=run, vocab_size=vocab_size)
    if not isinstance(columns, TrajectoryColumns):
        raise DecodeError("expected a trajectory group, got kind 'scored'")
    return columns


def decode_scored_columns(fields: Mapping[bytes, bytes], *, run: str | None = None,
                          vocab_size: int | None = None) -> ScoredColumns:
    """``decode_scored``'s checks, the values left unassembled (``ScoredColumns``)."""
    columns = decode_columns(fields, run=run, vocab_size=vocab_size)
    if not isinstance(columns, ScoredColumns):
        raise DecodeError("expected a scored group, got kind 'traj'")
    return columns


def decode_trajectory(fields: Mapping[bytes, bytes], *, run: str | None = None,
                      vocab_size: int | None = None) -> TrajectoryGroup:
    """Decode an entry that must be a trajectory group (``decode``'s checks)."""
    return decode_trajectory_columns(fields, run=run, vocab_size=vocab_size).group()


def decode_scored(fields: Mapping[bytes, bytes], *, run: str | None = None,
                  vocab_size: int | None = None) -> ScoredGroup:
    """Decode an entry that must be a scored group (``decode``'s checks)."""
    return decode_scored_columns(fields, run=run, vocab_size=vocab_size).group()


def scored_rewards(fields: Mapping[bytes, bytes]) -> list[float]:
    """The sequence rewards of a scored entry, either form, without decoding the rest."""
    check_version(fields)
    rewards = whole_array(fields, b"rewards", F32)
    if not np.isfinite(rewards).all():
        raise DecodeError("rewards are not finite")
    return [float(r) for r in rewards]
