"""The codec refuses what the contract forbids: every malformed-entry case, the values the
contract forbids in arrays and numbers (decoding and encoding), and, property-based, any
mutation of an entry decodes to a valid message or raises DecodeError."""

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
    DecodeError,
    SequenceScore,
    UnknownVersionError,
    decode,
    decode_trajectory,
    encode,
)
from tests.codec_strategies import groups
from tests.factories import make_group, score


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
