"""The codec: round-trips (property-based), the binary layout, broadcasts, the reference
form and the columns. Every malformed-entry case: `test_codec_malformed.py`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollq.schemas import (
    Completion,
    DeadLetter,
    DecodeError,
    ScoredGroup,
    TrajectoryGroup,
    broadcast,
    decode,
    decode_dead,
    decode_scored,
    decode_trajectory,
    encode,
    encode_dead,
    encode_scores,
    is_broadcast,
    join_trajectory,
    scored_rewards,
    trajectory_ref,
)
from rollq.schemas.decoding import decode_scored_columns, decode_trajectory_columns
from tests.codec_strategies import groups
from tests.factories import make_group, score


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
    assert fields[b"v"] == b"2" and fields[b"kind"] == b"traj"


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


def test_columns_hold_what_decode_returns_and_encode_scores_takes_them() -> None:
    group = make_group(group_size=3, tokens=5)
    scored = score(group)
    traj_columns = decode_trajectory_columns(encode(group))
    assert encode(traj_columns.group()) == encode(decode_trajectory(encode(group))) == encode(group)
    assert traj_columns.group() is traj_columns.group()  # assembled once
    columns = decode_scored_columns(encode(scored))
    assert encode(columns.group()) == encode(scored)
    assert columns.group().model_dump() == scored.model_dump()
    assert (columns.group_id, columns.policy_version, columns.num_sequences,
            columns.sequence_tokens) == (group.group_id, group.policy_version, 3,
                                    3 * len(group.prompt_ids) + 15)
    assert columns.token_advantages is None  # a broadcast does not travel
    with pytest.raises(DecodeError, match="expected a scored group"):
        decode_scored_columns(encode(group))
    with pytest.raises(DecodeError, match="expected a trajectory group"):
        decode_trajectory_columns(encode(scored))
    # the scorer's shortcut: the scores written from the columns, in both forms
    values: dict[str, Any] = {
        "rewards": [s.reward for s in scored.scores],
        "advantages": [s.advantage for s in scored.scores],
        "token_advantages": [s.token_advantages for s in scored.scores],
        "token_rewards": None, "components": [s.components for s in scored.scores],
        "weights": scored.weights, "flags": scored.flags,
        "reward_config": scored.reward_config, "scored_at": scored.scored_at}
    for trajectory_id in ("7-0", None):
        assert (encode_scores(traj_columns, trajectory_id=trajectory_id, **values)
                == encode_scores(group, trajectory_id=trajectory_id, **values)
                == encode(scored, trajectory_id=trajectory_id))


def test_join_refuses_another_groups_trajectory() -> None:
    fields = encode(score(make_group(group_id="a")), trajectory_id="7-0")
    with pytest.raises(DecodeError, match="does not hold this group"):
        join_trajectory(fields, encode(make_group(group_id="b")))
