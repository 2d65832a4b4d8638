"""The reward bridge: presets, combination, error policies, placement, advantages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rollq.consumers.scorer import (
    ComponentSettings,
    MissingFieldError,
    RewardBridge,
    RewardComponent,
    RewardConfig,
    Sample,
    ScoringError,
)
from tests.scorer.helpers import make_sample

CUSTOM = "tests.scorer.custom_components"
R1_GOOD = "<think>\nsome thought\n</think>\n<answer>\n$\\frac{1}{2}$\n</answer>"


class Halver(RewardComponent[ComponentSettings]):
    """A custom component defined in this test module: 0.5 per "x" in the text."""

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        return 0.5 * sample.text.count("x")


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned pool workers import custom components by module name and get the parent's
    # sys.path: put the repository root on it, however pytest was started.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


def config(components: list[dict[str, Any]], **rest: Any) -> RewardConfig:
    return RewardConfig.from_mapping({"components": components, **rest})


async def test_r1_preset_scores_accuracy_format_and_tags() -> None:
    cfg = RewardConfig.from_mapping({
        "preset": "r1", "pool": {"workers": 1},
        "components": [{"name": "accuracy", "settings": {"gold_field": "solution"}}]})
    gold = {"solution": "$\\frac{1}{2}$"}
    group = [make_sample(R1_GOOD, metadata=gold),
             make_sample(R1_GOOD.replace("frac{1}{2}", "frac{1}{3}"), metadata=gold),
             make_sample("The answer is $\\frac{1}{2}$", metadata=gold)]
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group(group)
    assert result.components == {"accuracy": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0],
                                 "tag_count": [1.0, 1.0, 0.0]}
    assert result.rewards == [3.0, 2.0, 1.0]
    assert result.weights == {"accuracy": 1.0, "format": 1.0, "tag_count": 1.0}
    assert set(result.timings) == {"accuracy", "format", "tag_count"}
    assert all(seconds >= 0 for seconds in result.timings.values())
    assert result.advantages is not None
    np.testing.assert_allclose(result.advantages, [1.2247, 0.0, -1.2247], atol=1e-3)
    assert result.flags == ()


async def test_roll_universal_correctness_wins_in_a_group() -> None:
    # ROLL #426's bridge never let the correctness branch fire; with a group of 4 the
    # correct completion must get the correctness reward outright.
    cfg = RewardConfig.from_mapping({"preset": "roll_universal", "pool": {"workers": 1}})
    gold = {"answer": "2"}
    texts = ["<think>easy</think> \\boxed{2}", "<think>hmm</think> \\boxed{3}",
             "\\boxed{3}", "no idea"]
    group = [make_sample(text, metadata=gold) for text in texts]
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group(group)
    assert result.components["accuracy"] == [1.0, 0.0, 0.0, 0.0]
    expected = [1.0] + [-1.0 + bonus + len(text) / 1000
                        for bonus, text in zip([0.5, 0.3, 0.0], texts[1:], strict=True)]
    assert result.rewards == pytest.approx(expected)
    assert result.advantages is not None
    assert int(np.argmax(result.advantages)) == 0


async def test_custom_component_by_dotted_path_in_a_test_module() -> None:
    cfg = config([{"name": "halves", "component": f"{__name__}:Halver", "weight": 2.0},
                  {"name": "scaled", "component": f"{CUSTOM}:ScaledLength",
                   "settings": {"factor": 0.1}}])
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group([make_sample("xx"), make_sample("abcd")])
    assert result.components == {"halves": [1.0, 0.0], "scaled": [0.2, pytest.approx(0.4)]}
    assert result.rewards == pytest.approx([2.2, 0.4])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
async def test_zero_variance_drop_and_keep(method: str) -> None:
    entry = [{"name": "length", "component": "length_bounty", "settings": {"scale": 10.0}}]
    same = [make_sample("aaa"), make_sample("bbb")]  # shaped reward 0.2 each: mean ≠ 0/1
    async with RewardBridge(config(entry, advantages={"method": method})) as bridge:
        dropped = await bridge.score_group(same)
    assert dropped.rewards == pytest.approx([0.2, 0.2])
    assert (dropped.advantages, dropped.token_advantages) == (None, None)
    assert dropped.drop_reason == "zero_variance"
    keep = {"method": method, "zero_variance": "keep"}
    async with RewardBridge(config(entry, advantages=keep)) as bridge:
        kept = await bridge.score_group(same)
    assert kept.drop_reason is None
    assert kept.advantages is not None and kept.advantages.tolist() == [0.0, 0.0]
    assert kept.token_advantages is not None
    assert [t.tolist() for t in kept.token_advantages] == [[0.0] * 3, [0.0] * 3]


async def test_token_advantages_broadcast_sequence_advantage() -> None:
    entry = [{"name": "halves", "component": f"{__name__}:Halver"}]
    cfg = config(entry, advantages={"method": "dr_grpo"})
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group([make_sample("xx", tokens=2),
                                           make_sample("ab", tokens=3)])
    assert result.token_rewards is None
    assert result.token_advantages is not None
    assert [t.tolist() for t in result.token_advantages] == [[0.5, 0.5], [-0.5, -0.5, -0.5]]


@pytest.mark.parametrize("on_error", ["skip_component", "dead_letter"])
async def test_component_that_raises(on_error: str) -> None:
    cfg = config([{"name": "boom", "component": f"{CUSTOM}:Boom", "on_error": on_error},
                  {"name": "halves", "component": f"{__name__}:Halver"}])
    group = [make_sample("x boom"), make_sample("fine")]
    async with RewardBridge(cfg) as bridge:
        if on_error == "dead_letter":
            with pytest.raises(ScoringError, match="boom") as caught:
                await bridge.score_group(group)
            assert (caught.value.reason, caught.value.component) == ("error", "boom")
            assert "2 tries" in str(caught.value)  # retried once in-process by default
            return
        result = await bridge.score_group(group)
    # A failure is not a score: the value is unknown (None) and adds nothing.
    assert result.components["boom"] == [None, 1.0]
    assert result.rewards == [0.5, 1.0]
    [flag] = result.flags
    assert (flag.component, flag.sample, flag.reason, flag.policy) == (
        "boom", 0, "error", "skip_component")
    assert "RuntimeError: boom" in flag.detail
    assert result.flag_counts() == {"boom:error": 1}


async def loop_lag(stop: asyncio.Event, interval: float = 0.01) -> float:
    """The worst delay of a periodic ticker beyond its interval, in seconds."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(interval)
        worst = max(worst, loop.time() - before - interval)
    return worst


async def test_hanging_reward_times_out_without_blocking_the_loop() -> None:
    # The timeout is long beside any stall a loaded machine gives the loop (a few hundred
    # ms), so a blocked loop (a lag of the whole timeout) cannot be mistaken for load.
    cfg = config([{"name": "nap", "component": f"{CUSTOM}:Nap", "timeout_s": 2.0,
                   "on_error": "skip_component", "retries": 0,
                   "settings": {"spin": True}}], pool={"workers": 1})
    async with RewardBridge(cfg) as bridge:
        stop = asyncio.Event()
        ticker = asyncio.create_task(loop_lag(stop))
        started = asyncio.get_running_loop().time()
        result = await bridge.score_group([make_sample("nap forever"), make_sample("abc")])
        elapsed = asyncio.get_running_loop().time() - started
        stop.set()
        lag = await ticker
        # The spinning call was cut at its timeout (it never ends on its own: without the
        # cut, the test's own timeout would fail it), and the loop kept ticking meanwhile.
        # The end is the cut plus the replacement worker's start, ~3 s on a quiet machine
        # and 12 s once beside a second suite: the bound only says "not another timeout".
        assert 2.0 <= elapsed < 60.0
        # Had the call blocked the loop, the lag would be the whole 2 s timeout; well below
        # it with room for a loaded 2-core machine (a spinning worker takes one core).
        assert lag < 1.0
        assert result.components["nap"] == [None, 3.0]
        assert result.flag_counts() == {"nap:timeout": 1}
        # The one worker was killed and replaced: the pool still serves calls.
        again = await bridge.score_group([make_sample("abcd"), make_sample("ab")])
        assert again.components["nap"] == [4.0, 2.0]
        assert again.flags == ()


async def test_slow_reward_within_timeout_and_dead_letter_on_timeout() -> None:
    cfg = config([{"name": "nap", "component": f"{CUSTOM}:Nap", "timeout_s": 0.3,
                   "on_error": "dead_letter", "settings": {"seconds": 30}}],
                 pool={"workers": 2})
    async with RewardBridge(cfg) as bridge:
        ok = await bridge.score_group([make_sample("ab"), make_sample("abc")])
        assert ok.components["nap"] == [2.0, 3.0]
        with pytest.raises(ScoringError) as caught:
            await bridge.score_group([make_sample("nap"), make_sample("abc")])
        assert (caught.value.reason, caught.value.component) == ("timeout", "nap")


async def test_missing_gold_field_is_a_clear_error() -> None:
    cfg = config([{"name": "acc", "component": "accuracy",
                   "settings": {"kind": "gsm8k", "gold_field": "solution"}}])
    async with RewardBridge(cfg) as bridge:
        with pytest.raises(MissingFieldError, match="'solution'") as caught:
            await bridge.score_group([make_sample("#### 2", metadata={"answer": "2"})])
    assert caught.value.field == "solution"
    assert caught.value.component == "acc"


async def test_correctness_feeds_cosine_and_batch_scoped_length() -> None:
    components: list[dict[str, Any]] = [
        {"name": "accuracy", "component": "accuracy", "weight": 0.0,
         "settings": {"kind": "gsm8k"}},
        {"name": "cosine", "component": "cosine", "settings": {"max_len": 100}},
        {"name": "by_group", "component": "length", "weight": 0.0},
        {"name": "by_batch", "component": "length", "weight": 0.0,
         "settings": {"scope": "batch"}},
    ]
    gold = {"answer": "#### 7"}
    first = [make_sample("#### 7", metadata=gold), make_sample("#### 8" + "x" * 44,
                                                               metadata=gold)]
    second = [make_sample("#### 7" + "x" * 94, metadata=gold)]
    async with RewardBridge(config(components)) as bridge:
        scored = await bridge.score_batch([first, second])
    one, two = scored
    assert one.components["accuracy"] == [1.0, 0.0]
    # cosine: correct at 6/100 chars, wrong at 50/100 chars.
    assert one.components["cosine"] == pytest.approx([0.9956, -0.75], abs=1e-4)
    # group scope: lengths 6 and 50 within the first group.
    assert one.components["by_group"] == pytest.approx([0.5, -0.5])
    assert two.components["by_group"] == [0.0]
    # batch scope: lengths 6, 50, 100 over both groups.
    assert one.components["by_batch"] == pytest.approx([0.5, min(0.0, 0.5 - 44 / 94)])
    assert two.components["by_batch"] == pytest.approx([-0.5])


async def test_process_rewards_through_the_bridge() -> None:
    components = [{"name": "steps", "component": "process", "weight": 2.0}]
    cfg = config(components, advantages={"process_component": "steps", "eps": 0.0})
    text = "<think>ab\n\ncd</think>x"
    group = [make_sample(text, completion_metadata={"step_labels": [1, 0]}),
             make_sample(text, completion_metadata={"step_labels": [1, 1]})]
    async with RewardBridge(cfg) as bridge:
        result = await bridge.score_group(group)
    assert result.components["steps"] == [0.0, 1.0]
    assert result.token_rewards is not None
    assert result.token_rewards[0][[8, 12]].tolist() == [2.0, 0.0]
    assert result.token_rewards[1][[8, 12]].tolist() == [2.0, 2.0]
    assert float(result.token_rewards[1].sum()) == 4.0
    # Steps {1, 0, 1, 1}: mean 0.75, std sqrt(3)/4; 1 -> 1/sqrt(3), 0 -> -sqrt(3).
    high, low = 1 / np.sqrt(3), -np.sqrt(3)
    assert result.token_advantages is not None
    np.testing.assert_allclose(result.token_advantages[0][[0, 8, 9, 12, 13]],
                               [high + low, high + low, low, low, 0.0], rtol=1e-5)
    np.testing.assert_allclose(result.token_advantages[1][[0, 9, 13]],
                               [2 * high, high, 0.0], rtol=1e-5)


async def test_prm_served_over_http_and_its_failure_skipped() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        steps = json.loads(request.content)["steps"]
        if "bad" in steps[0]:
            return httpx.Response(500)
        return httpx.Response(200, json={"scores": [0.9] * len(steps)})

    components = [{"name": "prm", "component": "process", "on_error": "skip_component",
                   "settings": {"source": "prm", "prm": {"url": "http://prm.test/"}}}]
    group = [make_sample("<think>good\n\nstep</think>1"), make_sample("<think>bad</think>2")]
    async with RewardBridge(config(components),
                            transport=httpx.MockTransport(handle)) as bridge:
        result = await bridge.score_group(group)
    assert result.components["prm"] == [pytest.approx(0.9), None]
    assert result.flag_counts() == {"prm:prm_error": 1}
