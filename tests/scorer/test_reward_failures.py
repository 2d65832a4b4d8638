"""A reward failure is never a score: retried in-process, then the group is retried by the
stage and dead-lettered ``reward_error``; or, under ``skip_component``, the value is None."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import ReaderSettings, StreamReader
from rollq.consumers.scorer import RewardBridge, RewardConfig, ScoringError
from rollq.consumers.scorer import bridge as bridge_module
from rollq.consumers.scorer.consumer import Scorer
from rollq.consumers.scorer.pool import WorkerPool
from rollq.consumers.stage import Stage
from rollq.producers.publisher import Publisher
from rollq.schemas import decode_dead
from rollq.schemas.failures import MISSING_FIELD, REWARD_ERROR
from rollq.schemas.keys import counters_key, stream_key
from tests.factories import make_group
from tests.redis_server import free_port
from tests.scorer.helpers import make_sample

CUSTOM = "tests.scorer.custom_components"
RUN = "failures"
TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned pool workers import the custom components by module name.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


def config(*components: dict[str, Any], **rest: Any) -> RewardConfig:
    return RewardConfig.from_mapping({"components": list(components),
                                      "advantages": {"zero_variance": "keep"}, **rest})


def reader(redis: aioredis.Redis, **settings: Any) -> StreamReader:
    return StreamReader(redis, [TRAJ], "scorers", "s1",
                        ReaderSettings(block_ms=20, reclaim_idle_ms=0, **settings))


async def publish(redis: aioredis.Redis, *texts: str, group_id: str = "g",
                  metadata: dict[str, object] | None = None) -> None:
    await Publisher(redis, RUN).publish(make_group(
        run=RUN, group_id=group_id, group_size=len(texts), texts=list(texts),
        metadata=metadata or {"answer": "42"}))


async def dead_letters(redis: aioredis.Redis) -> list[Any]:
    return [decode_dead(fields) for _, fields in await redis.xrange(DEAD)]


@pytest.fixture
async def boom_bridge() -> AsyncIterator[RewardBridge]:
    async with RewardBridge(config(
            {"name": "boom", "component": f"{CUSTOM}:Boom"},
            {"name": "length", "component": "length_bounty"})) as bridge:
        yield bridge


# -- in the bridge ------------------------------------------------------------------------


async def test_a_failed_call_is_retried_in_process_before_it_counts() -> None:
    flaky = {"name": "flaky", "component": f"{CUSTOM}:Flaky", "settings": {"failures": 1}}
    async with RewardBridge(config(flaky)) as bridge:
        result = await bridge.score_group([make_sample("a"), make_sample("bb")])
    assert result.components["flaky"] == [1.0, 1.0] and result.flags == ()
    async with RewardBridge(config({**flaky, "retries": 0})) as bridge:
        with pytest.raises(ScoringError, match="'flaky'") as caught:
            await bridge.score_group([make_sample("a"), make_sample("bb")])
    assert caught.value.component == "flaky" and "1 tries" in str(caught.value)
    twice = {**flaky, "settings": {"failures": 2}, "retries": 2}
    async with RewardBridge(config(twice)) as bridge:
        started = time.perf_counter()
        result = await bridge.score_group([make_sample("a")])
    assert result.components["flaky"] == [1.0]
    assert time.perf_counter() - started >= 0.05 + 0.1  # backed off between tries


async def test_skip_component_is_unknown_not_wrong() -> None:
    """A failed correctness component: None, flagged, out of the total; cosine and length
    see correct=None (never False), so they skip too."""
    cfg = config(
        {"name": "judge", "component": f"{CUSTOM}:Boom", "on_error": "skip_component"},
        {"name": "cosine", "component": "cosine", "settings": {"max_len": 100}},
        {"name": "length", "component": "length"},
        {"name": "bounty", "component": "length_bounty", "settings": {"scale": 100}},
        correctness="judge")
    group = [make_sample("boom"), make_sample("fine answer")]
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group(group)
    assert result.components["judge"] == [None, 1.0]
    assert result.components["cosine"][0] is None and result.components["length"][0] is None
    assert result.components["cosine"][1] == pytest.approx(
        0.5 + 0.25 * (1 + math.cos(math.pi * 11 / 100)))  # correct, 11 of 100 chars
    assert result.rewards[0] == pytest.approx(0.04)  # only the bounty: 4 chars / 100
    [flag] = result.flags
    assert (flag.component, flag.sample, flag.reason, flag.policy) == (
        "judge", 0, "error", "skip_component")


async def test_a_timeout_is_a_failure_like_an_exception() -> None:
    nap = {"name": "nap", "component": f"{CUSTOM}:Nap", "timeout_s": 0.3,
           "settings": {"seconds": 30}}
    async with RewardBridge(config(nap, pool={"workers": 1})) as bridge:
        with pytest.raises(ScoringError) as caught:
            await bridge.score_group([make_sample("nap"), make_sample("abc")])
        assert (caught.value.reason, caught.value.component) == ("timeout", "nap")
        assert "2 tries" in str(caught.value)
    skipped = {**nap, "on_error": "skip_component", "retries": 0}
    async with RewardBridge(config(skipped, pool={"workers": 1})) as bridge:
        result = await bridge.score_group([make_sample("nap"), make_sample("abc")])
    assert result.components["nap"] == [None, 3.0]
    assert result.flag_counts() == {"nap:timeout": 1}


async def wait_for_pid(marker: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(marker.exists):
        assert time.monotonic() < deadline, "the pool worker never started the call"
        await asyncio.sleep(0.02)
    return int(await asyncio.to_thread(marker.read_text))


@pytest.mark.parametrize("retries", [0, 1])
async def test_a_killed_pool_process_is_replaced_and_its_call_is_a_failure(
    tmp_path: Path, retries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge_module, "POOL_CALL_SAMPLES", 1)  # a call of its own
    marker = tmp_path / "pid"
    entry = {"name": "nap", "component": f"{CUSTOM}:NapOnce", "retries": retries,
             "timeout_s": 60, "settings": {"marker": str(marker)}}
    async with RewardBridge(config(entry, pool={"workers": 1})) as bridge:
        call = asyncio.create_task(bridge.score_group([make_sample("nap"), make_sample("ab")]))
        os.kill(await wait_for_pid(marker), signal.SIGKILL)
        if retries:  # retried in-process on the replacement worker: a real value
            result = await call
            assert result.components["nap"] == [3.0, 2.0] and result.flags == ()
        else:  # not a 0: the reward is unknown, the group fails
            with pytest.raises(ScoringError) as caught:
                await call
            assert (caught.value.reason, caught.value.component) == ("worker_died", "nap")
        assert bridge._pool is not None and bridge._pool.replaced == 1
        again = await bridge.score_group([make_sample("nap"), make_sample("abc")])
        assert again.components["nap"] == [3.0, 3.0]  # the pool lives on


async def test_run_each_answers_each_item_in_one_call() -> None:
    async with WorkerPool(1) as pool:
        results = await pool.run_each(int, ["1", "x", "30"], timeout_s=30)
        assert results[0] == 1 and results[2] == 30
        assert isinstance(results[1], ScoringError) and results[1].reason == "error"
        assert "ValueError" in str(results[1])
        assert pool.replaced == 0  # an item that raised does not cost the worker


async def test_a_pool_call_of_several_samples_that_dies_is_made_again_one_sample_a_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The call died as a whole: none of its samples is to blame yet, so none has used a
    # try. Each is called again alone (no retries configured) and scores.
    monkeypatch.setattr(bridge_module, "POOL_CALL_SAMPLES", 4)
    marker = tmp_path / "pid"
    entry = {"name": "nap", "component": f"{CUSTOM}:NapOnce", "retries": 0,
             "timeout_s": 60, "settings": {"marker": str(marker)}}
    texts = ["a", "nap", "abc", "ab", "abcd"]
    assert len(texts) > bridge_module.POOL_CALL_SAMPLES > 1
    async with RewardBridge(config(entry, pool={"workers": 1})) as bridge:
        call = asyncio.create_task(bridge.score_group([make_sample(t) for t in texts]))
        os.kill(await wait_for_pid(marker), signal.SIGKILL)
        result = await call
        assert result.components["nap"] == [1.0, 3.0, 3.0, 2.0, 4.0] and result.flags == ()
        assert bridge._pool is not None and bridge._pool.replaced == 1


async def test_a_sample_that_raises_in_a_pool_call_fails_alone(tmp_path: Path) -> None:
    entry = {"name": "boom", "component": f"{CUSTOM}:Boom", "run_in": "process",
             "retries": 0, "on_error": "skip_component"}
    texts = ["ok", "boom", "okay", "fine"]
    async with RewardBridge(config(entry, pool={"workers": 1})) as bridge:
        result = await bridge.score_group([make_sample(t) for t in texts])
    assert result.components["boom"][1] is None
    assert [value is not None for value in result.components["boom"]] == [True, False, True, True]
    assert result.flag_counts() == {"boom:error": 1}


# -- under the stage ----------------------------------------------------------------------


async def test_a_failing_component_dead_letters_the_group_after_the_stage_attempts(
    redis: aioredis.Redis, boom_bridge: RewardBridge
) -> None:
    await publish(redis, "boom", "fine")
    await publish(redis, "fine", "longer fine", group_id="good")
    stage = Stage(reader(redis, max_deliveries=3), Scorer(boom_bridge, "cfg", redis))
    await stage.drain()  # delivery 1: the bad group stays pending, the good one goes
    assert (stage.forwarded, stage.left_pending, stage.dead_lettered) == (1, 1, 0)
    for _ in range(2):  # deliveries 2 and 3, as the scorer's periodic reclaim makes them
        await stage.process(await stage.reader.reclaim())
    assert (stage.left_pending, stage.dead_lettered) == (2, 1)
    [letter] = await dead_letters(redis)
    assert letter.reason == REWARD_ERROR and letter.deliveries == 3
    assert "'boom'" in letter.detail and "after 3 tries" in letter.detail
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0
    assert await redis.hget(counters_key(RUN, 0), "drop:reward_error") == b"1"


async def test_missing_field_is_dead_lettered_at_once(redis: aioredis.Redis) -> None:
    accuracy = {"name": "accuracy", "component": "accuracy", "settings": {"kind": "gsm8k"}}
    async with RewardBridge(config(accuracy)) as bridge:
        stage = Stage(reader(redis, max_deliveries=5), Scorer(bridge, "cfg", redis))
        await publish(redis, "#### 1", "#### 2", metadata={"question": "?"})
        await stage.drain()
    assert (stage.left_pending, stage.dead_lettered) == (0, 1)
    [letter] = await dead_letters(redis)
    assert letter.reason == MISSING_FIELD and letter.deliveries == 1
    assert "'answer'" in letter.detail and "'accuracy'" in letter.detail


async def test_skipped_components_are_flagged_and_counted(redis: aioredis.Redis) -> None:
    cfg = config({"name": "boom", "component": f"{CUSTOM}:Boom", "on_error": "skip_component"},
                 {"name": "length", "component": "length_bounty"})
    async with RewardBridge(cfg) as bridge:
        await publish(redis, "boom", "fine")
        stage = Stage(reader(redis), Scorer(bridge, "cfg", redis))
        await stage.drain()
    assert stage.forwarded == 1
    assert await redis.hget(counters_key(RUN, 0), "flag:boom:error") == b"1"


async def test_redis_failing_while_counting_flags_leaves_the_entry_pending(
    real_redis: aioredis.Redis,
) -> None:
    cfg = config({"name": "boom", "component": f"{CUSTOM}:Boom", "on_error": "skip_component"},
                 {"name": "length", "component": "length_bounty"})
    unreachable = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    async with RewardBridge(cfg) as bridge:
        await publish(real_redis, "boom", "fine")
        stage = Stage(reader(real_redis), Scorer(bridge, "cfg", unreachable))
        await stage.drain()
        assert (stage.forwarded, stage.left_pending, stage.dead_lettered) == (0, 1, 0)
        assert await real_redis.xlen(DEAD) == 0
        assert (await real_redis.xpending(TRAJ, "scorers"))["pending"] == 1
        # Redis is back (for the flags): the retry forwards the group and counts its flag.
        retry = Stage(reader(real_redis), Scorer(bridge, "cfg", real_redis))
        await retry.process(await retry.reader.reclaim())
    await unreachable.aclose()
    assert retry.forwarded == 1 and await real_redis.xlen(SCORED) == 1
    assert await real_redis.hget(counters_key(RUN, 0), "flag:boom:error") == b"1"


async def test_a_running_scorer_retries_its_own_pending_entries(
    real_redis: aioredis.Redis,
) -> None:
    """Not only at start: the reclaim of ``run`` takes this consumer's own idle entries."""
    flaky = {"name": "flaky", "component": f"{CUSTOM}:Flaky", "retries": 0,
             "settings": {"failures": 1}}
    async with RewardBridge(config(flaky, {"name": "length", "component": "length_bounty"})
                            ) as bridge:
        settings = ReaderSettings(block_ms=20, reclaim_idle_ms=100, reclaim_every_s=0.05)
        stage = Stage(StreamReader(real_redis, [TRAJ], "scorers", "s1", settings),
                      Scorer(bridge, "cfg", real_redis))
        await publish(real_redis, "a", "bb")
        stop = asyncio.Event()
        task = asyncio.create_task(stage.run(stop))
        deadline = time.monotonic() + 20
        while await real_redis.xlen(SCORED) == 0:
            assert time.monotonic() < deadline, "the pending entry was never retried"
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 10)
    assert (stage.left_pending, stage.forwarded, stage.dead_lettered) == (1, 1, 0)
