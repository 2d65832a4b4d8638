"""The codec: round-trips (property-based) and every malformed-entry case."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    Completion,
    ContractError,
    DeadLetter,
    DecodeError,
    ScoredGroup,
    TrajectoryGroup,
    UnknownVersionError,
    broadcast,
    decode,
    decode_dead,
    decode_scored,
    decode_trajectory,
    encode,
    encode_dead,
    is_broadcast,
    join_trajectory,
    scored_rewards,
    trajectory_ref,
)
from tests.factories import make_group, score

token_ids = st.integers(min_value=0, max_value=2**31 - 1)
logprobs32 = st.floats(width=32, allow_nan=False, allow_infinity=False).map(lambda x: -abs(x))
texts = st.text(max_size=40)


@st.composite
def completions(draw: st.DrawFn) -> Completion:
    n = draw(st.integers(1, 40))
    versioned = draw(st.booleans())
    return Completion(
        completion_ids=draw(st.lists(token_ids, min_size=n, max_size=n)),
        logprobs=draw(st.lists(logprobs32, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        token_versions=draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
        if versioned
        else None,
        policy_version=draw(st.integers(0, 99)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        text=draw(texts),
        reasoning=draw(st.none() | texts),
        messages=draw(st.none() | st.just([{"role": "assistant", "content": "hi"}])),
        turn_rewards=draw(st.lists(st.floats(-10, 10), max_size=3)),
        info=draw(st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1),
                                  max_size=3)),
    )


@st.composite
def groups(draw: st.DrawFn) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=draw(st.text(min_size=1, max_size=20)),
        run="run",
        env=draw(st.text(min_size=1, max_size=10)),
        policy_version=draw(st.integers(0, 10**6)),
        prompt_ids=draw(st.lists(token_ids, max_size=30)),
        prompt_text=draw(texts),
        completions=tuple(draw(st.lists(completions(), min_size=1, max_size=5))),
        metadata=draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)),
        created_at=draw(st.floats(0, 2e9)),
    )


def assert_same_group(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    # token_versions equal to the sequence version everywhere decode as absent (same meaning)
    exclude = {"completions": {"__all__": {"token_versions"}}}
    assert a.model_dump(exclude=exclude) == b.model_dump(exclude=exclude)
    for x, y in zip(a.completions, b.completions, strict=True):
        assert x.completion_ids.dtype == np.int32 and y.completion_ids.dtype == np.int32
        assert np.array_equal(x.logprobs, y.logprobs)
        assert np.array_equal(x.versions, y.versions)


@settings(max_examples=60, deadline=None)
@given(groups())
def test_trajectory_round_trip(group: TrajectoryGroup) -> None:
    decoded = decode_trajectory(encode(group))
    assert_same_group(group, decoded)


@settings(max_examples=30, deadline=None)
@given(groups(), st.data())
def test_scored_round_trip(group: TrajectoryGroup, data: st.DataObject) -> None:
    finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
    n = len(group.completions)
    rewards = data.draw(st.lists(finite, min_size=n, max_size=n))
    scored = score(group, rewards)
    decoded = decode_scored(encode(scored))
    assert isinstance(decoded, ScoredGroup)
    assert_same_group(scored.trajectory, decoded.trajectory)
    exclude = {"trajectory": True, "scores": {"__all__": {"advantage"}}}
    assert decoded.model_dump(exclude=exclude) == scored.model_dump(exclude=exclude)
    # rewards and advantages travel as float32
    for got, sent in zip(decoded.scores, scored.scores, strict=True):
        assert got.advantage == float(np.float32(sent.advantage))


def test_token_arrays_are_little_endian_binary() -> None:
    group = make_group(group_size=2, tokens=3)
    fields = encode(group)
    ids = np.concatenate([c.completion_ids for c in group.completions])
    assert fields[b"completion_ids"] == ids.astype("<i4").tobytes()
    assert fields[b"lengths"] == np.array([3, 3], "<i4").tobytes()
    assert fields[b"v"] == b"1" and fields[b"kind"] == b"traj"


def test_decoded_arrays_are_read_only_views() -> None:
    decoded = decode_trajectory(encode(make_group()))
    with pytest.raises(ValueError):
        decoded.completions[0].completion_ids[0] = 1


def test_model_does_not_freeze_callers_array() -> None:
    ids = np.arange(4, dtype=np.int32)
    Completion(completion_ids=ids, logprobs=np.zeros(4), loss_mask=np.ones(4), policy_version=0)
    ids[0] = 7  # still the caller's writable array


def test_mismatched_per_token_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="logprobs has 3 values for 4"):
        Completion(completion_ids=[1, 2, 3, 4], logprobs=[0, 0, 0], loss_mask=[1, 1, 1, 1],
                   policy_version=0)


def _fields() -> dict[bytes, bytes]:
    return encode(make_group(group_size=2, tokens=4))


MALFORMED = {
    "garbage": ({b"junk": b"\x00\xff\xfe"}, DecodeError, "missing field 'v'"),
    "unknown_version": ({**_fields(), b"v": b"99"}, UnknownVersionError, "unknown schema version"),
    "unknown_kind": ({**_fields(), b"kind": b"weird"}, DecodeError, "unknown kind"),
    "missing_meta": ({k: v for k, v in _fields().items() if k != b"meta"}, DecodeError,
                     "missing field 'meta'"),
    "bad_json": ({**_fields(), b"meta": b"{not json"}, DecodeError, "'meta' is invalid.*JSON"),
    "short_ids": ({**_fields(), b"completion_ids": b"\x01\x02\x03"}, DecodeError,
                  "'completion_ids' has 3 bytes"),
    "wrong_lengths": ({**_fields(), b"lengths": np.array([4, 5], "<i4").tobytes()}, DecodeError,
                      "expected 9 x 4"),
    "odd_lengths": ({**_fields(), b"lengths": b"\x01"}, DecodeError, "not a multiple of 4"),
    "negative_length": ({**_fields(), b"lengths": np.array([-4, 12], "<i4").tobytes()},
                        DecodeError, "negative"),
    "meta_count": ({**_fields(), b"lengths": np.array([8], "<i4").tobytes(),
                    b"text_lengths": np.array([len(_fields()[b"texts"])], "<i4").tobytes()},
                   DecodeError, "1 lengths"),
    "bad_version_number": ({**_fields(), b"policy_version": b"x"}, DecodeError, "invalid"),
    "negative_version": ({**_fields(), b"policy_version": b"-1"}, DecodeError,
                         "invalid trajectory group.*policy_version"),
    "empty_group_id": ({**_fields(), b"group_id": b""}, DecodeError,
                       "invalid trajectory group.*group_id"),
    "no_completions": ({**_fields(), b"lengths": b"", b"text_lengths": b"", b"texts": b"",
                        b"completion_ids": b"", b"logprobs": b"", b"loss_mask": b""},
                       DecodeError, "meta has 2 completions for 0 lengths"),
    "empty_group": ({**_fields(), b"lengths": b"", b"text_lengths": b"", b"texts": b"",
                     b"completion_ids": b"", b"logprobs": b"", b"loss_mask": b"",
                     b"meta": orjson.dumps({**orjson.loads(_fields()[b"meta"]),
                                            "completions": []})},
                    DecodeError, "has no completions"),
    "missing_meta_key": ({**_fields(), b"meta": b"{}"}, DecodeError, "'meta' is invalid"),
    "wrong_meta_type": ({**_fields(), b"meta": _fields()[b"meta"].replace(
        b'"finish_reason":"', b'"finish_reason":1,"x":"')}, DecodeError, "'meta' is invalid"),
    "texts_cut_wrong": ({**_fields(), b"texts": _fields()[b"texts"] + b"x"}, DecodeError,
                        "does not cut"),
    "texts_not_utf8": ({**_fields(), b"texts": b"\xff" * len(_fields()[b"texts"])},
                       DecodeError, "'texts' is not UTF-8"),
    "non_utf8_id": ({**_fields(), b"group_id": b"\xff\xfe"}, DecodeError, "not UTF-8"),
    "scored_without_scores": ({**_fields(), b"kind": b"scored"}, DecodeError,
                              "missing field 'rewards'"),
    "scored_bad_meta": ({**encode(score(make_group())), b"score_meta": b'{"flags": 3}'},
                        DecodeError, "'score_meta' is invalid"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_entries_raise_decode_error(case: str) -> None:
    fields, error, message = MALFORMED[case]
    with pytest.raises(error, match=message):
        decode(fields)


def test_unserialisable_metadata_is_a_contract_error() -> None:
    # The model refuses it when built; encode refuses it in a model built without
    # validation (model_copy), and names what orjson cannot write.
    with pytest.raises(ValueError, match="metadata holds an integer beyond 64 bits"):
        make_group(metadata={"big": 2**70})
    with pytest.raises(ContractError, match="not JSON-serialisable"):
        encode(make_group().model_copy(update={"metadata": {"big": 2**70}}))
    with pytest.raises(ContractError, match="non-finite number"):
        encode(make_group().model_copy(update={"metadata": {"x": float("nan")}}))


def test_dead_letter_round_trip_keeps_payload_bytes() -> None:
    letter = DeadLetter(reason="decode_error", detail="bad", source_stream="s", source_id="1-0",
                        consumer_group="scorers", deliveries=2, dead_at=12.5,
                        payload={b"v": b"1", b"blob": b"\x00\xff"})
    assert decode_dead(encode_dead(letter)) == letter


def test_token_advantages_travel_only_when_not_a_broadcast() -> None:
    group = make_group(group_size=2, tokens=3)
    plain = encode(score(group, [0.0, 1.0]))
    assert b"token_advantages" not in plain
    decoded = decode_scored(plain)
    assert decoded.scores[1].token_advantages.tolist() == [0.5, 0.5, 0.5]
    shaped = score(group, [0.0, 1.0])
    shaped = shaped.model_copy(update={"scores": (
        shaped.scores[0].model_copy(update={"token_advantages": np.array([1, 2, 3], np.float32)}),
        shaped.scores[1])})
    fields = encode(shaped)
    assert b"token_advantages" in fields
    assert decode_scored(fields).scores[0].token_advantages.tolist() == [1.0, 2.0, 3.0]


def test_broadcast_views_cost_no_per_token_memory() -> None:
    views = broadcast(np.array([0.5, -2.0]), [3, 0])
    assert [v.tolist() for v in views] == [[0.5, 0.5, 0.5], []]
    assert all(v.dtype == np.float32 and v.strides == (0,) for v in views)
    with pytest.raises(ValueError):
        views[0][0] = 1.0  # read-only
    with pytest.raises(ValueError, match="2 values for 3 lengths"):
        broadcast([1.0, 2.0], [1, 1, 1])
    with pytest.raises(ValueError, match="negative length"):
        broadcast([1.0], [-1])
    assert broadcast([], []) == []


def test_is_broadcast_reads_stride_zero_views_and_checks_other_arrays() -> None:
    assert is_broadcast(broadcast([0.5], [4])[0], 0.5)
    assert not is_broadcast(broadcast([0.5], [4])[0], 0.25)
    assert is_broadcast(np.full(4, 0.5, np.float32), 0.5)
    assert not is_broadcast(np.array([0.5, 0.5, 0.5, 0.4], np.float32), 0.5)
    assert is_broadcast(np.zeros(0, np.float32), 3.0)


def test_a_stride_zero_view_of_another_value_still_travels() -> None:
    # A broadcast of something other than the sequence advantage is token-level data.
    group = make_group(group_size=2, tokens=3)
    scored = score(group, [0.0, 1.0])
    odd = scored.scores[0].model_copy(update={"token_advantages": broadcast([9.0], [3])[0]})
    fields = encode(scored.model_copy(update={"scores": (odd, scored.scores[1])}))
    assert b"token_advantages" in fields
    decoded = decode_scored(fields)
    assert decoded.scores[0].token_advantages.tolist() == [9.0, 9.0, 9.0]
    assert decoded.scores[1].token_advantages.tolist() == [0.5, 0.5, 0.5]


def test_reference_form_joins_back_to_the_inline_form() -> None:
    group = make_group()
    traj_fields = encode(group)
    fields = encode(score(group), trajectory_id="7-0")
    assert trajectory_ref(fields) == "7-0" and trajectory_ref(traj_fields) is None
    assert not {b"meta", b"completion_ids", b"logprobs", b"loss_mask"} & set(fields)
    with pytest.raises(DecodeError, match="join it first"):
        decode(fields)
    joined = join_trajectory(fields, traj_fields)
    assert joined == encode(score(group))
    assert all(joined[k] is traj_fields[k] for k in (b"meta", b"completion_ids"))  # no copy
    assert scored_rewards(fields) == scored_rewards(joined) == [s.reward for s in
                                                               score(group).scores]


def test_join_refuses_another_groups_trajectory() -> None:
    fields = encode(score(make_group(group_id="a")), trajectory_id="7-0")
    with pytest.raises(DecodeError, match="does not hold this group"):
        join_trajectory(fields, encode(make_group(group_id="b")))
