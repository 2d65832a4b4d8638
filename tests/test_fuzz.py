"""Fuzzing the pipeline: thousands of malformed entries, written straight into the traj and
scored streams of a real redis-server between valid groups, go through the real scorer
stage and the real trainer client.

Acceptance (issue 12): no consumer crashes; every malformed entry is dead-lettered exactly
once, with a reason; every valid group reaches the trainer exactly once; no batch holds a
malformed group or a non-finite value. Each malformed kind is built to be invalid by
construction (a kind whose entry could happen to be valid would make the test flaky), and
the failure message names the kinds of any entry that was not dead-lettered.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.consumers.bus import ReaderSettings, StreamReader
from rollq.consumers.scorer import RewardBridge, RewardConfig
from rollq.consumers.scorer.consumer import Scorer
from rollq.consumers.stage import Stage
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.schemas import Completion, TrajectoryGroup, decode_dead, encode
from rollq.schemas.keys import PARTITIONS_FIELD, state_key, stream_key
from tests.factories import score

MALFORMED_ENTRIES = 10_500
"""Malformed entries over both streams (about two thirds traj, one third scored)."""
VALID_GROUPS = 200
SEED = 20_240_612
RUN = "fuzz"
TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")
Fields = dict[bytes, bytes]
Rng = np.random.Generator


# -- valid groups -------------------------------------------------------------------------


def valid_group(rng: Rng, index: int) -> TrajectoryGroup:
    """A small valid group; some have per-token versions, metadata and env tokens."""
    size, tokens = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    version = int(rng.integers(0, 4))
    completions = []
    for i in range(size):
        mask = rng.integers(0, 2, tokens).astype(np.uint8)
        logprobs = np.where(mask == 1, -rng.random(tokens) * 3, 0.0).astype(np.float32)
        versions = None
        if index % 3 == 0:
            versions = np.full(tokens, version, np.int32)
            versions[tokens // 2:] += 1
        completions.append(Completion(
            completion_ids=rng.integers(0, 32_000, tokens, dtype=np.int32), logprobs=logprobs,
            loss_mask=mask, policy_version=version, token_versions=versions,
            finish_reason="stop", text="x" * int(rng.integers(0, 40)) + f" completion {i}",
            info={"turns": 1, "score": float(rng.random())}, turn_rewards=[0.5]))
    return TrajectoryGroup(
        group_id=f"valid-{index:05d}", run=RUN, env="fuzz", policy_version=version,
        prompt_ids=rng.integers(0, 32_000, int(rng.integers(1, 6)), dtype=np.int32),
        prompt_text="what is 1+1?", completions=tuple(completions),
        metadata={"answer": "2", "index": index, "weights": [1.5, -2.0]},
        created_at=1.7e9, finished_at=1.7e9 + 3.5)


# -- malformed kinds ----------------------------------------------------------------------

TRAJ_ARRAYS = (b"completion_ids", b"logprobs", b"loss_mask")
REQUIRED = (b"v", b"kind", b"group_id", b"run", b"env", b"policy_version", b"meta", b"texts",
            b"text_lengths", b"lengths", b"prompt_ids", *TRAJ_ARRAYS)
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def _lengths(fields: Fields) -> list[int]:
    return np.frombuffer(fields[b"lengths"], "<i4").tolist()  # type: ignore[no-any-return]


def _set_array(fields: Fields, name: bytes, dtype: str, rng: Rng, value: Any) -> Fields:
    """``fields`` with one random element of array ``name`` set to ``value``."""
    array = np.frombuffer(fields[name], dtype).copy()
    array[int(rng.integers(len(array)))] = value
    return {**fields, name: array.tobytes()}


def _json_field(fields: Fields, name: bytes, change: Callable[[dict[str, Any]], None],
                literals: dict[str, bytes] | None = None) -> Fields:
    """``fields`` with the JSON of field ``name`` changed; ``literals`` replaces quoted
    placeholders by raw JSON tokens (NaN, 1e999) that no JSON writer emits."""
    meta = orjson.loads(fields[name])
    change(meta)
    raw = orjson.dumps(meta)
    for placeholder, token in (literals or {}).items():
        raw = raw.replace(orjson.dumps(placeholder), token)
    return {**fields, name: raw}


def _meta(fields: Fields, change: Callable[[dict[str, Any]], None],
          literals: dict[str, bytes] | None = None) -> Fields:
    """``fields`` with its meta JSON changed (``_json_field``)."""
    return _json_field(fields, b"meta", change, literals)


def _non_finite_token(rng: Rng) -> bytes:
    return [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-2.5e400"][int(rng.integers(5))]


def _bytes(rng: Rng, low: int = 0, high: int = 24) -> bytes:
    return rng.bytes(int(rng.integers(low, high)))


def _cut(rng: Rng, raw: bytes, unit: int) -> bytes:
    """``raw`` shortened by 1..unit-1 bytes (a whole unit fewer could still be valid)."""
    return raw[:max(0, len(raw) - int(rng.integers(1, unit)))] if unit > 1 else raw[:-1]


TrajKind = Callable[[Rng, Fields], Fields]


def _traj_kinds() -> dict[str, TrajKind]:
    kinds: dict[str, TrajKind] = {
        "random_fields": lambda r, f: {_bytes(r, 1, 8): _bytes(r) for _ in range(3)},
        "empty_entry": lambda r, f: {b"v": b"1"},
        "huge_declared_length": lambda r, f: {**f, b"lengths": np.array(
            [2**31 - 1] * len(_lengths(f)), "<i4").tobytes()},
        "negative_length": lambda r, f: {**f, b"lengths": np.array(
            [-1, *_lengths(f)[1:]], "<i4").tobytes()},
        "lengths_count": lambda r, f: {**f, b"lengths": f[b"lengths"] + np.array(
            [0], "<i4").tobytes()},
        "mis_split_empty": lambda r, f: {**f, b"lengths": np.array(
            [0, sum(_lengths(f))] + [0] * (len(_lengths(f)) - 2), "<i4").tobytes()}
        if len(_lengths(f)) > 1 else {**f, b"lengths": np.array([sum(_lengths(f)) + 1],
                                                                "<i4").tobytes()},
        "text_lengths_sum": lambda r, f: {**f, b"text_lengths": np.array(
            [len(f[b"texts"]) + 1] + [0] * (len(_lengths(f)) - 1), "<i4").tobytes()},
        "negative_text_length": lambda r, f: {**f, b"text_lengths": np.array(
            [-1] * len(_lengths(f)), "<i4").tobytes()},
        "texts_not_utf8": lambda r, f: {**f, b"texts": b"\xff" + f[b"texts"][1:]}
        if f[b"texts"] else {**f, b"texts": b"\xff"},
        "unknown_version": lambda r, f: {**f, b"v": [b"0", b"3", b"99", b"", b"1.0", b"v1",
                                                     b"\x01"][int(r.integers(7))]},
        "unknown_kind": lambda r, f: {**f, b"kind": [b"", b"dead", b"TRAJ", b"\xff",
                                                     b"group"][int(r.integers(5))]},
        "scored_kind_without_scores": lambda r, f: {**f, b"kind": b"scored"},
        "meta_random_bytes": lambda r, f: {**f, b"meta": b"\xff" + _bytes(r)},
        "meta_truncated": lambda r, f: {**f, b"meta": f[b"meta"][:int(r.integers(
            1, len(f[b"meta"])))]},
        "meta_not_an_object": lambda r, f: {**f, b"meta": [b"[]", b"null", b"1", b'"x"'][
            int(r.integers(4))]},
        "meta_extra_key": lambda r, f: _meta(f, lambda m: m.update(surprise=1)),
        "meta_missing_key": lambda r, f: _meta(f, lambda m: m.pop("completions")),
        "meta_completion_count": lambda r, f: _meta(f, lambda m: m["completions"].append(
            m["completions"][0])),
        "meta_wrong_type": lambda r, f: _meta(f, lambda m: m["completions"][0].update(
            finish_reason=7)),
        "meta_nan_metadata": lambda r, f: _meta(f, lambda m: m["metadata"].update(x="@"),
                                                {"@": _non_finite_token(r)}),
        "meta_nan_info": lambda r, f: _meta(f, lambda m: m["completions"][0]["info"].update(
            deep=[{"x": "@"}]), {"@": _non_finite_token(r)}),
        "meta_nan_turn_reward": lambda r, f: _meta(
            f, lambda m: m["completions"][0].update(turn_rewards=["@"]),
            {"@": _non_finite_token(r)}),
        "meta_nan_created_at": lambda r, f: _meta(f, lambda m: m.update(created_at="@"),
                                                  {"@": _non_finite_token(r)}),
        "meta_completion_version_2_31": lambda r, f: _meta(
            f, lambda m: m["completions"][0].update(policy_version=2**31)),
        "meta_completion_version_negative": lambda r, f: _meta(
            f, lambda m: m["completions"][0].update(policy_version=-1)),
        "meta_completion_version_10_30": lambda r, f: _meta(
            f, lambda m: m["completions"][0].update(policy_version="@"),
            {"@": b"1" + b"0" * 30}),
        "empty_group_id": lambda r, f: {**f, b"group_id": b""},
        "empty_env": lambda r, f: {**f, b"env": b""},
        "group_id_not_utf8": lambda r, f: {**f, b"group_id": b"\xfe\xff" + f[b"group_id"]},
        "version_2_31": lambda r, f: {**f, b"policy_version": str(2**31).encode()},
        "version_10_30": lambda r, f: {**f, b"policy_version": b"1" + b"0" * 30},
        "version_negative": lambda r, f: {**f, b"policy_version": b"-1"},
        "version_not_a_number": lambda r, f: {**f, b"policy_version": [
            b"x", b"", b"1_0", b" 1", b"1.5", b"0x10", b"\xff"][int(r.integers(7))]},
        "positive_logprob": lambda r, f: _set_array(f, b"logprobs", "<f4", r,
                                                    float(r.uniform(1e-3, 50))),
        "non_finite_logprob": lambda r, f: _set_array(f, b"logprobs", "<f4", r,
                                                      NON_FINITE[int(r.integers(3))]),
        "negative_token_id": lambda r, f: _set_array(f, b"completion_ids", "<i4", r,
                                                     int(r.integers(-(2**31), 0))),
        "negative_prompt_id": lambda r, f: _set_array(f, b"prompt_ids", "<i4", r,
                                                      int(r.integers(-(2**31), 0))),
        "mask_of_7": lambda r, f: _set_array(f, b"loss_mask", "<u1", r, 7),
        "mask_above_1": lambda r, f: _set_array(f, b"loss_mask", "<u1", r,
                                                int(r.integers(2, 256))),
        "negative_token_version": lambda r, f: _set_array(
            {**f, b"token_versions": np.zeros(sum(_lengths(f)), "<i4").tobytes()},
            b"token_versions", "<i4", r, int(r.integers(-(2**31), 0))),
        "foreign_run": lambda r, f: {**f, b"run": [b"other", b"fuzz2", b"FUZZ", b""][
            int(r.integers(4))]},
        "no_completions": lambda r, f: _meta(
            {**f, **dict.fromkeys((b"lengths", b"text_lengths", b"texts", *TRAJ_ARRAYS),
                                  b"")}, lambda m: m.update(completions=[])),
    }
    for name in REQUIRED:
        kinds[f"missing_{name.decode()}"] = lambda r, f, name=name: {
            k: v for k, v in f.items() if k != name}
    for name, unit in ((b"completion_ids", 4), (b"logprobs", 4), (b"loss_mask", 1),
                       (b"lengths", 4), (b"text_lengths", 4), (b"prompt_ids", 4)):
        kinds[f"truncated_{name.decode()}"] = lambda r, f, name=name, unit=unit: {
            **f, name: _cut(r, f[name], unit)} if f[name] else {**f, name: b"\x00"}
    for name in TRAJ_ARRAYS:  # extra bytes: more values than the lengths say
        kinds[f"extended_{name.decode()}"] = lambda r, f, name=name: {
            **f, name: f[name] + _bytes(r, 1, 9)}
    for name, unit in ((b"completion_ids", 4), (b"logprobs", 4), (b"loss_mask", 1)):
        kinds[f"wrong_dtype_{name.decode()}"] = lambda r, f, name=name, unit=unit: {
            **f, name: np.frombuffer(f[name], f"<u{unit}").astype(
                "<f8" if unit == 4 else "<i2").tobytes()}
    return kinds


ScoredKind = Callable[[Rng, Fields, Fields, str], Fields]
"""(rng, scored reference-form fields, the same group inline, another traj id) -> fields."""


def _score_meta(fields: Fields, change: Callable[[dict[str, Any]], None],
                literals: dict[str, bytes] | None = None) -> Fields:
    return _json_field(fields, b"score_meta", change, literals)


def _per_token(inline: Fields) -> int:
    return sum(_lengths(inline))


def _scored_kinds(traj_kinds: dict[str, TrajKind]) -> dict[str, ScoredKind]:
    absurd = [b"99999999999999999999999-0", str(2**64).encode() + b"-0",
              b"0-" + str(2**64).encode(), "\u0663-0".encode(), b"1-2-3", b"", b"-",
              b"1-", b"abc", b"\xff\xfe", b"1-0 ", b"+1-0"]
    kinds: dict[str, ScoredKind] = {
        "rewards_non_finite": lambda r, f, i, o: _set_array(f, b"rewards", "<f4", r,
                                                            NON_FINITE[int(r.integers(3))]),
        "advantages_non_finite": lambda r, f, i, o: _set_array(
            f, b"advantages", "<f4", r, NON_FINITE[int(r.integers(3))]),
        "rewards_wrong_length": lambda r, f, i, o: {**f, b"rewards": f[b"rewards"] + b"\0" * 4},
        "advantages_missing": lambda r, f, i, o: {k: v for k, v in f.items()
                                                  if k != b"advantages"},
        "token_advantages_nan": lambda r, f, i, o: {**f, b"token_advantages": np.full(
            _per_token(i), np.nan, "<f4").tobytes()},
        "token_advantages_one_inf": lambda r, f, i, o: _set_array(
            {**f, b"token_advantages": np.zeros(_per_token(i), "<f4").tobytes()},
            b"token_advantages", "<f4", r, NON_FINITE[int(r.integers(3))]),
        "token_advantages_wrong_length": lambda r, f, i, o: {
            **f, b"token_advantages": np.zeros(_per_token(i) + 1, "<f4").tobytes()},
        "token_rewards_non_finite": lambda r, f, i, o: _set_array(
            {**f, b"token_rewards": np.zeros(_per_token(i), "<f4").tobytes()},
            b"token_rewards", "<f4", r, NON_FINITE[int(r.integers(3))]),
        "score_meta_bad_json": lambda r, f, i, o: {**f, b"score_meta": b"{" + _bytes(r)},
        "score_meta_nan_weight": lambda r, f, i, o: _score_meta(
            f, lambda m: m["weights"].update(length="@"), {"@": _non_finite_token(r)}),
        "score_meta_nan_component": lambda r, f, i, o: _score_meta(
            f, lambda m: m["components"][0].update(toy="@"), {"@": _non_finite_token(r)}),
        "score_meta_component_count": lambda r, f, i, o: _score_meta(
            f, lambda m: m["components"].append({})),
        "score_meta_wrong_type": lambda r, f, i, o: _score_meta(
            f, lambda m: m.update(flags="not a list")),
        "score_meta_nan_scored_at": lambda r, f, i, o: _score_meta(
            f, lambda m: m.update(scored_at="@"), {"@": _non_finite_token(r)}),
        "absurd_traj_ref": lambda r, f, i, o: {**f, b"traj": absurd[int(r.integers(
            len(absurd)))]},
        "gone_traj_ref": lambda r, f, i, o: {**f, b"traj": b"1-" + str(int(r.integers(
            1, 10**9))).encode()},
        "ref_to_another_group": lambda r, f, i, o: {**f, b"traj": o.encode()},
        "foreign_run": lambda r, f, i, o: {**f, b"run": b"elsewhere"},
        "unknown_version": lambda r, f, i, o: {**f, b"v": [b"3", b"0", b""][int(r.integers(3))]},
        "traj_kind_with_ref": lambda r, f, i, o: {**f, b"kind": b"traj"},
        "missing_rewards": lambda r, f, i, o: {k: v for k, v in f.items() if k != b"rewards"},
        "missing_score_meta": lambda r, f, i, o: {k: v for k, v in f.items()
                                                  if k != b"score_meta"},
        "random_fields": lambda r, f, i, o: {b"v": b"1", b"kind": b"scored",
                                             b"traj": _bytes(r), _bytes(r, 1, 6): _bytes(r)},
    }
    # the inline form, with every value kind of the traj stream
    for name in ("positive_logprob", "non_finite_logprob", "negative_token_id", "mask_of_7",
                 "negative_prompt_id", "version_2_31", "version_10_30", "meta_nan_metadata",
                 "mis_split_empty", "negative_token_version", "meta_nan_info"):
        kinds[f"inline_{name}"] = lambda r, f, i, o, name=name: traj_kinds[name](r, i)
    return kinds


# -- the run ------------------------------------------------------------------------------


@dataclass
class Plan:
    """What was written: ids of valid traj entries and of every malformed entry's kind."""

    valid: dict[str, str] = field(default_factory=dict)  # group id -> traj entry id
    malformed: dict[tuple[str, str], str] = field(default_factory=dict)  # (stream, id) -> kind


async def write_streams(redis: aioredis.Redis, rng: Rng) -> Plan:
    traj_kinds = _traj_kinds()
    scored_kinds = _scored_kinds(traj_kinds)
    groups = [valid_group(rng, i) for i in range(VALID_GROUPS)]
    inline = [encode(score(g, [float(x) for x in rng.normal(size=len(g.completions))]))
              for g in groups]
    # a few malformed traj entries keep a valid identity, so a scored entry can name one
    ops = (["valid"] * VALID_GROUPS + ["traj"] * (MALFORMED_ENTRIES * 2 // 3)
           + ["scored"] * (MALFORMED_ENTRIES - MALFORMED_ENTRIES * 2 // 3))
    order = rng.permutation(len(ops))
    plan = Plan()
    written: list[tuple[int, str]] = []  # (group index, traj id) of valid groups so far
    traj_names, scored_names = sorted(traj_kinds), sorted(scored_kinds)
    await redis.hset(state_key(RUN), PARTITIONS_FIELD, "1")
    pipe = redis.pipeline(transaction=False)
    pending: list[tuple[str, str, int]] = []  # (stream, kind, group index) per XADD

    async def flush() -> None:
        for (stream, kind, index), entry_id in zip(pending, await pipe.execute(), strict=True):
            entry = entry_id.decode()
            if kind == "valid":
                plan.valid[groups[index].group_id] = entry
                written.append((index, entry))
            else:
                plan.malformed[(stream, entry)] = kind
        pending.clear()

    next_valid = 0
    for op in (ops[i] for i in order):
        if op == "scored" and len(written) < 2:
            op = "traj"  # scored poison names valid traj entries: wait for two
        if op == "valid":
            pipe.xadd(TRAJ, encode(groups[next_valid]))  # type: ignore[arg-type]
            pending.append((TRAJ, "valid", next_valid))
            next_valid += 1
            await flush()  # its id is needed by later scored entries
            continue
        template = groups[int(rng.integers(VALID_GROUPS))]
        if op == "traj":
            kind = traj_names[int(rng.integers(len(traj_names)))]
            fields = traj_kinds[kind](rng, encode(template))
            pipe.xadd(TRAJ, fields)  # type: ignore[arg-type]
            pending.append((TRAJ, kind, -1))
        else:
            (index, traj_id), (_, other) = (written[int(rng.integers(len(written)))]
                                            for _ in range(2))
            if other == traj_id:
                other = written[0][1] if written[0][1] != traj_id else written[1][1]
            kind = scored_names[int(rng.integers(len(scored_names)))]
            reference = encode(score(groups[index]), trajectory_id=traj_id)
            fields = scored_kinds[kind](rng, reference, inline[index], other)
            pipe.xadd(SCORED, fields)  # type: ignore[arg-type]
            pending.append((SCORED, kind, index))
        if len(pending) >= 256:
            await flush()
    await flush()
    return plan


def reward_config() -> RewardConfig:
    return RewardConfig.from_mapping({
        "components": [{"name": "length", "component": "length_bounty"}],
        "advantages": {"zero_variance": "keep"}})


@pytest.mark.slow
async def test_malformed_entries_never_crash_a_reader_nor_reach_a_training_step(
    real_redis: aioredis.Redis,
) -> None:
    redis = real_redis
    await redis.flushdb()
    rng = np.random.default_rng(SEED)
    plan = await write_streams(redis, rng)
    assert len(plan.malformed) == MALFORMED_ENTRIES
    assert len(set(plan.malformed.values())) >= 80  # kinds used

    # the real scorer stage (as ops.roles.run_scorer wires it), in drain mode
    with capture_logs() as scorer_logs:
        async with RewardBridge(reward_config()) as bridge:
            reader = StreamReader(redis, [TRAJ], "scorers", "scorer-1",
                                  ReaderSettings(block_ms=0, count=256))
            stage = Stage(reader, Scorer(bridge, "fuzz", redis), concurrency=256)
            await stage.drain()
    assert stage.forwarded == VALID_GROUPS
    # the stage dead-letters what it cannot decode; the reader, entries of another run
    traj_kinds = Counter(kind for (stream, _), kind in plan.malformed.items() if stream == TRAJ)
    assert stage.dead_lettered == traj_kinds.total() - traj_kinds["foreign_run"]
    assert not [e for e in scorer_logs if e["log_level"] == "error"]  # no bug was hit

    # the real trainer client: batches until every valid group has come
    settings = TrainerClientSettings(block_ms=20, max_staleness=None, reclaim_every_s=3600,
                                     vocab_size=32_000)
    trained: Counter[str] = Counter()
    forwarded = {entry_id.decode() for entry_id, _ in await redis.xrange(SCORED)} - {
        entry_id for stream, entry_id in plan.malformed if stream == SCORED}
    deadline = time.monotonic() + 60
    with capture_logs() as trainer_logs:
        async with TrainerClient(redis, run=RUN, consumer="fuzz", settings=settings) as trainer:
            while sum(trained.values()) < VALID_GROUPS and time.monotonic() < deadline:
                batch = await trainer.next_batch(groups=16, timeout_s=1.0)
                assert set(batch.entry_ids) <= forwarded  # only the scorer's own entries
                for array in (batch.advantages, batch.sampler_logprobs, batch.rewards):
                    assert np.isfinite(array).all()
                assert batch.sampler_logprobs.max(initial=0) <= 0
                assert set(np.unique(batch.loss_mask)) <= {0.0, 1.0}
                assert batch.input_ids.min(initial=0) >= 0
                assert batch.input_ids.max(initial=0) < 32_000
                trained.update(batch.group_ids)
                await batch.ack()
    assert not [e for e in trainer_logs if e["log_level"] == "error"]
    assert sorted(trained) == sorted(plan.valid)  # every valid group, each once
    assert set(trained.values()) == {1}

    letters = [decode_dead(f) for _, f in await redis.xrange(DEAD, count=10 * MALFORMED_ENTRIES)]
    lettered = Counter((letter.source_stream, letter.source_id) for letter in letters)
    missed = Counter(kind for ref, kind in plan.malformed.items() if ref not in lettered)
    assert not missed, f"malformed entries not dead-lettered, by kind: {dict(missed)}"
    assert set(lettered) == set(plan.malformed) and set(lettered.values()) == {1}
    reasons = Counter(letter.reason for letter in letters)
    # Only contract reasons: an unexpected_error would mean the codec raised something
    # other than DecodeError on some input.
    assert set(reasons) <= {"decode_error", "unknown_version_error", "trajectory_missing"}, reasons
    assert all(letter.detail for letter in letters)
    counters = await redis.hgetall(f"rollq:{{{RUN}:0}}:counters")
    assert sum(int(v) for k, v in counters.items() if k.startswith(b"drop:")) == len(letters)
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0
    assert (await redis.xpending(SCORED, "trainer"))["pending"] == 0
