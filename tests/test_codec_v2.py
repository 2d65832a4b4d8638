"""Schema version 2 (issue 44): each completion may say how it was sampled (``sampling``)
and carry the experts a MoE server routed it through (``routed_experts``); entries of
version 1, written before, still decode."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rollq.schemas import Completion, DecodeError, decode, decode_trajectory, encode
from rollq.schemas.columns import TrajectoryColumns
from rollq.schemas.decoding import decode_columns
from rollq.schemas.models import SamplingRecord, TrajectoryGroup
from tests.factories import make_group

SAMPLING = SamplingRecord(temperature=1.0, top_p=0.9, top_k=None, min_p=0.0,
                          logprobs_mode="raw_logprobs", model="policy-3")


def with_completions(group: TrajectoryGroup, **fields: object) -> TrajectoryGroup:
    """``group`` with ``fields`` set on every completion (validated again)."""
    completions = tuple(Completion(**{**c.model_dump(), **fields}) for c in group.completions)
    return TrajectoryGroup(**{**group.model_dump(), "completions": completions})


def routed(group: TrajectoryGroup, dtype: str = "uint8", layers: int = 3,
           top_k: int = 2) -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    prompt = len(group.prompt_ids)
    completions = tuple(Completion(**{**c.model_dump(), "routed_experts": rng.integers(
        0, 8, (prompt + len(c.completion_ids) - 1, layers, top_k)).astype(dtype)})
        for c in group.completions)
    return TrajectoryGroup(**{**group.model_dump(), "completions": completions})


def v1_fields(group: TrajectoryGroup) -> dict[bytes, bytes]:
    """The entry a rollq of schema version 1 wrote for ``group``: ``v`` 1, and no
    ``sampling`` or ``routed_experts`` key in meta's completions."""
    fields = encode(group)
    meta = orjson.loads(fields[b"meta"])
    for info in meta["completions"]:
        del info["sampling"], info["routed_experts"]
    return {**fields, b"v": b"1", b"meta": orjson.dumps(meta)}


def test_a_version_1_entry_still_decodes_without_sampling_or_routing() -> None:
    group = make_group(seed=3)
    decoded = decode_trajectory(v1_fields(group))
    assert [c.completion_ids.tolist() for c in decoded.completions] == [
        c.completion_ids.tolist() for c in group.completions]
    assert all(c.sampling is None and c.routed_experts is None for c in decoded.completions)


def test_sampling_travels_per_completion() -> None:
    group = with_completions(make_group(group_size=2), sampling=SAMPLING)
    fields = encode(group)
    assert fields[b"v"] == b"2"
    meta = orjson.loads(fields[b"meta"])
    assert meta["completions"][0]["sampling"] == {
        "temperature": 1.0, "top_p": 0.9, "top_k": None, "min_p": 0.0,
        "logprobs_mode": "raw_logprobs", "model": "policy-3"}
    decoded = decode_trajectory(fields)
    assert [c.sampling for c in decoded.completions] == [SAMPLING, SAMPLING]
    columns = decode_columns(fields)
    assert isinstance(columns, TrajectoryColumns) and columns.sampling() == [SAMPLING] * 2


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_routed_experts_travel_as_bytes_with_their_dtype_and_shape(dtype: str) -> None:
    group = routed(make_group(group_size=3, tokens=4), dtype)
    fields = encode(group)
    meta = orjson.loads(fields[b"meta"])
    assert meta["completions"][0]["routed_experts"] == {"dtype": dtype, "shape": [8, 3, 2]}
    assert len(fields[b"routed_experts"]) == 3 * 8 * 3 * 2 * np.dtype(dtype).itemsize
    decoded = decode(fields)
    for got, sent in zip(decoded.completions, group.completions, strict=True):  # type: ignore[union-attr]
        assert got.routed_experts is not None and sent.routed_experts is not None
        assert got.routed_experts.dtype == np.dtype(dtype)
        assert np.array_equal(got.routed_experts, sent.routed_experts)


def test_routing_is_optional_per_completion() -> None:
    group = routed(make_group(group_size=2))
    group = TrajectoryGroup(**{**group.model_dump(), "completions": (
        group.completions[0], Completion(**{**group.completions[1].model_dump(),
                                            "routed_experts": None}))})
    decoded = decode_trajectory(encode(group))
    assert decoded.completions[0].routed_experts is not None
    assert decoded.completions[1].routed_experts is None


def test_routing_must_cover_every_forwarded_position() -> None:
    group = make_group(group_size=1, tokens=4)  # prompt 5 + 4 tokens: 8 positions
    with pytest.raises(ValueError, match="9 positions, the sequence 8"):
        TrajectoryGroup(**{**group.model_dump(), "completions": (Completion(**{
            **group.completions[0].model_dump(),
            "routed_experts": np.zeros((9, 2, 2), np.uint8)}),)})
    with pytest.raises(ValueError, match="uint8, uint16, int32"):
        Completion(**{**group.completions[0].model_dump(),
                      "routed_experts": np.zeros((8, 2, 2), np.float32)})


@pytest.mark.parametrize(("change", "message"), [
    (lambda f, m: {**f, b"routed_experts": f[b"routed_experts"][:-1]}, "too few|layouts"),
    (lambda f, m: {k: v for k, v in f.items() if k != b"routed_experts"},
     "missing field 'routed_experts'"),
    (lambda f, m: {**f, b"meta": m(lambda c: c.update(routed_experts=None))},
     "present but meta gives no layout"),
    (lambda f, m: {**f, b"meta": m(lambda c: c.update(
        routed_experts={"dtype": "float32", "shape": [8, 3, 2]}))}, "routed_experts"),
])
def test_malformed_routing_is_a_decode_error(change: object, message: str) -> None:
    fields = encode(routed(make_group(group_size=2, tokens=4)))

    def meta(edit: object) -> bytes:
        document = orjson.loads(fields[b"meta"])
        for info in document["completions"]:
            edit(info)  # type: ignore[operator]
        return orjson.dumps(document)

    with pytest.raises(DecodeError, match=message):
        decode(change(fields, meta))  # type: ignore[operator]
