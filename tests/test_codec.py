"""The codec: round-trips (property-based) and every malformed-entry case."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollq.schemas import (
    Completion,
    ContractError,
    DeadLetter,
    DecodeError,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
    UnknownVersionError,
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


# -- values: the contract checks what arrays and numbers hold, both ways ------------------


def _scored_fields() -> dict[bytes, bytes]:
    group = make_group(group_size=2, tokens=4)
    shaped = score(group, [0.0, 1.0])
    # per-token advantages and rewards that are not a broadcast, so both fields travel
    scores = tuple(s.model_copy(update={"token_advantages": np.arange(4, dtype=np.float32),
                                        "token_rewards": np.ones(4, np.float32)})
                   for s in shaped.scores)
    return encode(shaped.model_copy(update={"scores": scores}))


def _f32(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


def _i32(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


def _meta(**changes: object) -> bytes:
    meta = orjson.loads(_fields()[b"meta"])
    completion = changes.pop("completion", None)
    if completion is not None:
        meta["completions"][0].update(completion)  # type: ignore[call-overload]
    return orjson.dumps({**meta, **changes}).replace(b'"@NaN"', b"NaN").replace(
        b'"@1e999"', b"1e999").replace(b'"@-Infinity"', b"-Infinity")


INVALID_VALUES = {
    "positive_logprob": ({b"logprobs": _f32(-0.5, 0.25, -1, -1, -1, -1, -1, -1)},
                         "'logprobs' holds 0.25, above"),
    "nan_logprob": ({b"logprobs": _f32(-0.5, float("nan"), -1, -1, -1, -1, -1, -1)},
                    "'logprobs' holds a non-finite"),
    "inf_logprob": ({b"logprobs": _f32(*[-1.0] * 7, float("inf"))}, "'logprobs' holds a non-f"),
    "minus_inf_logprob": ({b"logprobs": _f32(*[-1.0] * 7, float("-inf"))},
                          "'logprobs' holds a non-finite"),
    "negative_token_id": ({b"completion_ids": _i32(1, 2, -3, 4, 5, 6, 7, 8)},
                          "'completion_ids' holds -3, below"),
    "negative_prompt_id": ({b"prompt_ids": _i32(1, -2)}, "'prompt_ids' holds -2"),
    "mask_of_7": ({b"loss_mask": bytes([1, 1, 7, 1, 0, 0, 1, 1])}, "'loss_mask' holds 7"),
    "negative_token_version": ({b"token_versions": _i32(0, 0, -1, 0, 0, 0, 0, 0)},
                               "'token_versions' holds -1"),
    "version_2_31": ({b"policy_version": str(2**31).encode()}, "policy_version"),
    "version_10_30": ({b"policy_version": b"1" + b"0" * 30}, "policy_version"),
    "version_with_underscores": ({b"policy_version": b"1_0"}, "not a decimal integer"),
    "version_with_a_sign": ({b"policy_version": b"-0"}, "not a decimal integer"),
    "version_with_a_plus": ({b"policy_version": b"+1"}, "not a decimal integer"),
    "completion_version_2_31": ({b"meta": _meta(completion={"policy_version": 2**31})},
                                "'meta' is invalid.*policy_version"),
    "empty_completion": ({b"lengths": _i32(0, 8)}, "empty completion"),
    "nan_metadata": ({b"meta": _meta(metadata={"x": "@NaN"})}, "'meta' is invalid JSON"),
    "huge_metadata_number": ({b"meta": _meta(metadata={"x": ["@1e999"]})},
                             "'meta' is invalid JSON"),
    "infinite_info": ({b"meta": _meta(completion={"info": {"y": "@-Infinity"}})},
                      "'meta' is invalid JSON"),
    "nan_turn_reward": ({b"meta": _meta(completion={"turn_rewards": ["@NaN"]})},
                        "'meta' is invalid JSON"),
    "nan_rewards": ({b"rewards": _f32(float("nan"), 1.0)}, "'rewards' holds a non-finite"),
    "inf_advantages": ({b"advantages": _f32(0.0, float("inf"))}, "'advantages' holds a non-f"),
    "nan_token_advantages": ({b"token_advantages": _f32(*[0.0] * 7, float("nan"))},
                             "'token_advantages' holds a non-finite"),
    "inf_token_rewards": ({b"token_rewards": _f32(float("-inf"), *[0.0] * 7)},
                          "'token_rewards' holds a non-finite"),
    "nan_weight": ({b"score_meta": orjson.dumps({
        "components": [{}, {}], "weights": {"toy": "@NaN"}, "flags": [], "reward_config": "",
        "scored_at": 0.0}).replace(b'"@NaN"', b"NaN")}, "'score_meta' is invalid JSON"),
    "huge_scored_at": ({b"score_meta": b'{"components": [{}, {}], "weights": {}, "flags": [], '
                                      b'"reward_config": "", "scored_at": 2e308}'},
                       "'score_meta' is invalid JSON"),
}


@pytest.mark.parametrize("case", sorted(INVALID_VALUES))
def test_values_the_contract_forbids_raise_decode_error_naming_the_field(case: str) -> None:
    changes, message = INVALID_VALUES[case]
    fields = {**_scored_fields(), **changes}
    assert b"token_versions" not in fields or case == "negative_token_version"
    if case == "negative_token_version":
        fields[b"meta"] = _fields()[b"meta"]  # meta of the same lengths
    with pytest.raises(DecodeError, match=message):
        decode(fields)


def test_a_reader_checks_the_run_of_its_stream_and_the_vocabulary() -> None:
    fields = _fields()
    assert decode(fields, run="test", vocab_size=50_000).run == "test"
    with pytest.raises(DecodeError, match=r"field 'run' is 'test', but .* run 'other'"):
        decode(fields, run="other")
    fields[b"prompt_ids"] = _i32(1, 2)
    biggest = int(np.frombuffer(fields[b"completion_ids"], "<i4").max())
    with pytest.raises(DecodeError, match=f"'completion_ids' holds {biggest}, above"):
        decode_trajectory(fields, vocab_size=biggest)
    decode_trajectory(fields, vocab_size=biggest + 1)
    with pytest.raises(DecodeError, match="'prompt_ids' holds 2, above"):
        decode_trajectory(fields, vocab_size=2)


def test_models_refuse_forbidden_values_when_built() -> None:
    ok = {"completion_ids": [1, 2], "logprobs": [-0.1, 0.0], "loss_mask": [1, 0],
          "policy_version": 0}
    Completion(**ok)  # type: ignore[arg-type]
    for change, message in [({"logprobs": [0.1, 0.0]}, "logprobs holds"),
                            ({"completion_ids": [-1, 2]}, "completion_ids holds -1"),
                            ({"loss_mask": [1, 7]}, "loss_mask holds 7"),
                            ({"policy_version": 2**31}, "less than or equal"),
                            ({"token_versions": [0, -1]}, "token_versions holds -1"),
                            ({"completion_ids": [], "logprobs": [], "loss_mask": []},
                             "at least one token"),
                            ({"turn_rewards": [float("nan")]}, "finite"),
                            ({"info": {"x": [float("inf")]}}, "info holds a non-finite")]:
        with pytest.raises(ValueError, match=message):
            Completion(**{**ok, **change})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metadata holds a non-finite"):
        make_group(metadata={"x": {"y": float("nan")}})
    with pytest.raises(ValueError, match="token_advantages holds a non-finite"):
        SequenceScore(reward=0.0, advantage=0.0, token_advantages=[float("nan")])


def test_encode_refuses_forbidden_values_a_model_was_built_without_checking() -> None:
    group = make_group(group_size=2, tokens=3)
    bad = group.completions[0].model_copy(update={"logprobs": np.full(3, 0.5, np.float32)})
    with pytest.raises(ContractError, match=r"'logprobs' holds 0\.5"):
        encode(group.model_copy(update={"completions": (bad, group.completions[1])}))
    with pytest.raises(ContractError, match="outside"):
        encode(group.model_copy(update={"policy_version": 2**31}))
    scored = score(group)
    nan = scored.scores[0].model_copy(update={"token_advantages": np.full(3, np.nan,
                                                                          np.float32)})
    with pytest.raises(ContractError, match="'token_advantages' holds a non-finite"):
        encode(scored.model_copy(update={"scores": (nan, scored.scores[1])}),
               trajectory_id="1-0")


# -- property: any mutation decodes to a valid message or raises DecodeError ---------------


def _mutations() -> st.SearchStrategy[Any]:
    raw = st.binary(max_size=64)
    numbers = st.sampled_from([b"-1", b"0", b"2147483648", b"1" + b"0" * 30, b"NaN", b"1e999",
                               b"\xff", b"", b" 3", b"3_0"])
    jsonish = st.sampled_from([b"{}", b"[]", b"null", b"NaN", b'{"metadata": NaN}', b"{",
                               b'{"completions": [{}]}', b"1e999"])
    floats = st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1.0, -1.0,
                                       0.0, 3.4e38]), max_size=12).map(
        lambda v: np.array(v, "<f4").tobytes())
    ints = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12).map(
        lambda v: np.array(v, "<i4").tobytes())
    return st.one_of(raw, numbers, jsonish, floats, ints)


@st.composite
def mutated_entries(draw: st.DrawFn) -> dict[bytes, bytes]:
    group = draw(groups())
    n = len(group.completions)
    fields = encode(score(group, draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n))))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from([*sorted(fields), b"token_advantages", b"token_rewards",
                                     b"traj", b"extra"]))
        action = draw(st.sampled_from(["replace", "delete", "truncate", "flip", "append"]))
        value = fields.get(name, b"")
        if action == "replace":
            fields[name] = draw(_mutations())
        elif action == "delete":
            fields.pop(name, None)
        elif action == "truncate" and value:
            fields[name] = value[:draw(st.integers(0, len(value) - 1))]
        elif action == "flip" and value:
            at = draw(st.integers(0, len(value) - 1))
            fields[name] = value[:at] + bytes([value[at] ^ draw(st.integers(1, 255))]) + \
                value[at + 1:]
        else:
            fields[name] = value + draw(st.binary(min_size=1, max_size=8))
    return fields


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(mutated_entries())
def test_any_mutation_decodes_to_a_valid_message_or_raises_decode_error(
    fields: dict[bytes, bytes],
) -> None:
    try:
        message = decode(fields, run="run")
    except DecodeError:
        return  # never any other exception
    # what decoded is valid: the models accept it again, and it encodes (encode checks
    # every value) to an entry that decodes to the same message
    type(message).model_validate(message.model_dump())
    again = decode(encode(message), run="run")
    assert again.model_dump() == message.model_dump()
