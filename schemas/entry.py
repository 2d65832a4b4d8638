"""An entry's raw fields, as the codec reads them: lookups that name the missing or
malformed field, arrays sized and typed from the entry's bytes (zero-copy views), the UTF-8
texts, and the value checks of a group's arrays (schemas.models has the rules).

The codec's encode side (``schemas.codec``) and its decode side (``schemas.decoding``)
share these; everything here raises ``DecodeError`` naming the field, or ValueError for
the encode side to turn into ``ContractError``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from rollq.schemas.arrays import MAX_VERSION, check_values
from rollq.schemas.errors import DecodeError, UnknownVersionError
from rollq.schemas.models import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    check_routed_positions,
    check_tokens,
)

Fields = dict[bytes, bytes]
I32, F32, U8 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<u1")

TRAJECTORY_FIELDS = frozenset({
    b"v", b"group_id", b"run", b"env", b"policy_version", b"meta", b"texts", b"text_lengths",
    b"lengths", b"prompt_ids", b"completion_ids", b"logprobs", b"loss_mask", b"token_versions",
    b"routed_experts"})
"""The fields of a trajectory: what a join copies from a traj entry."""
IDENTITY_NAMES = ("group_id", "run", "env", "policy_version")
"""A group's identity fields: plain ASCII/UTF-8 in every group entry, traj and scored."""
IDENTITY_FIELDS = tuple(name.encode() for name in IDENTITY_NAMES)
TRAJECTORY_REF = b"traj"
"""Field of a reference-form scored entry: the id of its trajectory's traj entry."""


def field_bytes(fields: Mapping[bytes, bytes], name: bytes) -> bytes:
    """The bytes of field ``name``; DecodeError naming it when the entry lacks it."""
    try:
        return fields[name]
    except KeyError:
        raise DecodeError(f"missing field {name.decode()!r}") from None


def check_identity_values(policy_version: int, completion_versions: list[int]) -> None:
    """ValueError unless every policy version lies in [0, 2^31)."""
    for version in (policy_version, *completion_versions):
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"policy_version {version} is outside [0, 2^31)")


def check_field_values(name: bytes, array: Any, **bounds: float | None) -> None:
    """``check_values`` on a decoded field, raising DecodeError that names the field."""
    try:
        check_values(f"field {name.decode()!r}", array, **bounds)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def check_trajectory_values(fields: Mapping[bytes, bytes], lengths: list[int],
                             vocab_size: int | None) -> Any:
    """Check a trajectory's arrays (sizes and values, whole group at once); returns
    (prompt ids, completion ids, logprobs, loss mask, token versions or None) as views."""
    if min(lengths, default=0) < 0:
        raise DecodeError("field 'lengths' has a negative length")
    if min(lengths, default=1) == 0:
        raise DecodeError("field 'lengths' has an empty completion: each has at least one "
                          "token")
    total = sum(lengths)
    prompt_ids = whole_array(fields, b"prompt_ids", I32)
    ids = sized_array(fields, b"completion_ids", I32, total)
    logprobs = sized_array(fields, b"logprobs", F32, total)
    masks = sized_array(fields, b"loss_mask", U8, total)
    versions = None
    if b"token_versions" in fields:
        versions = sized_array(fields, b"token_versions", I32, total)
    high = None if vocab_size is None else vocab_size - 1
    check_field_values(b"prompt_ids", prompt_ids, low=0, high=high)
    try:
        check_tokens(completion_ids=ids, logprobs=logprobs, loss_mask=masks,
                     token_versions=versions, vocab_size=vocab_size, label="field '{}'")
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    return prompt_ids, ids, logprobs, masks, versions


def check_score_values(fields: Mapping[bytes, bytes], rewards: Any, advantages: Any,
                        total: int) -> tuple[Any, Any]:
    """Check a scored entry's arrays; returns (token advantages, token rewards), each the
    whole group's array or None when absent."""
    check_field_values(b"rewards", rewards)
    check_field_values(b"advantages", advantages)
    token_advantages = token_rewards = None
    if b"token_advantages" in fields:
        token_advantages = sized_array(fields, b"token_advantages", F32, total)
        check_field_values(b"token_advantages", token_advantages)
    if b"token_rewards" in fields:
        token_rewards = sized_array(fields, b"token_rewards", F32, total)
        check_field_values(b"token_rewards", token_rewards)
    return token_advantages, token_rewards


def sized_array(fields: Mapping[bytes, bytes], name: bytes, dtype: np.dtype[Any],
                count: int) -> Any:
    raw = field_bytes(fields, name)
    if len(raw) != count * dtype.itemsize:
        raise DecodeError(
            f"field {name.decode()!r} has {len(raw)} bytes, expected {count} x {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)


def whole_array(fields: Mapping[bytes, bytes], name: bytes, dtype: np.dtype[Any]) -> Any:
    """A field of any count of ``dtype`` values (its byte length a multiple of their size)."""
    raw = field_bytes(fields, name)
    if len(raw) % dtype.itemsize:
        raise DecodeError(f"field {name.decode()!r} has {len(raw)} bytes, not a multiple of "
                          f"{dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype)


def field_text(fields: Mapping[bytes, bytes], name: bytes) -> str:
    try:
        return field_bytes(fields, name).decode()
    except UnicodeDecodeError:
        raise DecodeError(f"field {name.decode()!r} is not UTF-8") from None


_READABLE = frozenset(str(v).encode() for v in READABLE_VERSIONS)


def check_version(fields: Mapping[bytes, bytes]) -> None:
    """Raise unless the entry carries a schema version this code reads (``READABLE_VERSIONS``:
    version 1 is version 2 without its optional fields)."""
    version = field_bytes(fields, b"v")
    if version not in _READABLE:
        raise UnknownVersionError(
            f"unknown schema version {version[:16]!r} (this code reads v="
            f"{', '.join(map(str, READABLE_VERSIONS))}; it writes v={SCHEMA_VERSION})")


def split_at(array: Any, offsets: list[int]) -> list[Any]:
    # plain slicing: np.split costs ~50 µs a call, a slice ~0.2 µs
    return [array[start:stop] for start, stop in itertools.pairwise(offsets)]


def offsets_of(lengths: list[int]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))  # ~3x np.cumsum for a group


def completion_texts(fields: Mapping[bytes, bytes], count: int) -> list[str]:
    """The completion texts: ``texts`` cut at the UTF-8 byte lengths in ``text_lengths``."""
    raw = field_bytes(fields, b"texts")
    lengths = sized_array(fields, b"text_lengths", I32, count).tolist()
    if min(lengths, default=0) < 0 or sum(lengths) != len(raw):
        raise DecodeError(f"field 'text_lengths' does not cut the {len(raw)} bytes of 'texts'")
    view = memoryview(raw)  # decode each text straight from the entry's bytes
    try:
        return [str(view[a:b], "utf-8") for a, b in itertools.pairwise(offsets_of(lengths))]
    except UnicodeDecodeError:
        raise DecodeError("field 'texts' is not UTF-8") from None


def short_error(exc: Exception) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def routed_arrays(fields: Mapping[bytes, bytes], layouts: list[Any], prompt_length: int,
                  lengths: list[int]) -> list[Any] | None:
    """Each completion's routed experts (a read-only ``[positions, layers, top_k]`` view of
    the ``routed_experts`` field, or None), cut by the dtypes and shapes ``meta`` gives;
    None when no completion has them. DecodeError when the bytes and the layouts disagree."""
    if all(layout is None for layout in layouts):
        if b"routed_experts" in fields:
            raise DecodeError("field 'routed_experts' is present but meta gives no layout")
        return None
    raw = field_bytes(fields, b"routed_experts")
    arrays: list[Any] = []
    offset = 0
    for index, layout in enumerate(layouts):
        if layout is None:
            arrays.append(None)
            continue
        dtype = np.dtype(layout["dtype"]).newbyteorder("<")
        shape = tuple(layout["shape"])
        size = int(np.prod(shape)) * dtype.itemsize
        if offset + size > len(raw):
            raise DecodeError(f"field 'routed_experts' has {len(raw)} bytes, too few for the "
                              f"layouts in meta (completion {index})")
        arrays.append(np.frombuffer(raw, dtype, int(np.prod(shape)), offset).reshape(shape))
        offset += size
    if offset != len(raw):
        raise DecodeError(f"field 'routed_experts' has {len(raw)} bytes, the layouts in meta "
                          f"{offset}")
    try:
        check_routed_positions(prompt_length, lengths, arrays)
        for array in arrays:
            if array is not None and array.size and array.min() < 0:
                raise ValueError("field 'routed_experts' holds a negative expert id")
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    return arrays
