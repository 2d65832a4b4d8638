"""The ``reasoning_gym`` reward component: reasoning-gym's own scorers through the bridge.

Items come from the real package (the ``reasoning_gym:`` env kind's metadata, built here as
the kind builds it); completions answer in ``<answer>`` tags after a ``<think>`` block. The
task's own ``score_answer`` decides: right answers 1.0, wrong ones its own 0.0, partial
credit kept; a scorer that raises (prime_factorization on an answer it cannot parse) is a
failed call, never a 0.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollq.consumers.scorer import RewardBridge, RewardConfig, ScoringError
from rollq.consumers.scorer.components.reasoning_gym import extract_answer
from rollq.schemas.tagged import encode_tagged
from tests.scorer.helpers import make_sample

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not "
                                    "installed")

TASKS = ("basic_arithmetic", "leg_counting", "caesar_cipher", "arc_1d", "n_queens")
"""Tasks checked here: arithmetic, counting, a cipher (partial credit by characters), ARC
1-D (tuples in its metadata) and n-queens (a board, several right answers)."""


def item(task: str, index: int = 0, **config: Any) -> dict[str, Any]:
    """The group metadata the ``reasoning_gym:TASK`` kind writes for item ``index``."""
    config = {"size": 8, "seed": 5, **config}
    entry = reasoning_gym.create_dataset(task, **config)[index]
    return {"reasoning_gym": {"dataset": task, "config": config, "index": index,
                              "entry": encode_tagged(entry)}, "answer": entry["answer"]}


def answered(text: str) -> str:
    return f"<think>working it out</think>\n<answer>{text}</answer>"


def bridge_config(**settings: Any) -> RewardConfig:
    entry: dict[str, Any] = {"name": "task", "component": "reasoning_gym", **settings}
    return RewardConfig.from_mapping({"components": [entry], "pool": {"workers": 1},
                                      "advantages": {"zero_variance": "keep"}})


def composite_groups() -> tuple[list[list[Any]], set[str]]:
    """Groups over a two-task composite's items (the right answer, then a wrong one)."""
    from reasoning_gym.composite import DatasetSpec

    specs = [{"name": "basic_arithmetic", "weight": 1.0, "config": {}},
             {"name": "leg_counting", "weight": 1.0, "config": {}}]
    config = {"size": 6, "seed": 1, "datasets": specs}
    dataset = reasoning_gym.create_dataset(
        "composite", size=6, seed=1, datasets=[DatasetSpec(**s) for s in specs])
    groups, sources = [], set()
    for index in range(6):
        entry = dataset[index]
        sources.add(entry["metadata"]["source_dataset"])
        metadata = {"reasoning_gym": {"dataset": "composite", "config": config, "index": index,
                                      "entry": encode_tagged(entry)}}
        groups.append([make_sample(answered(entry["answer"]), metadata=metadata),
                       make_sample(answered("-1"), metadata=metadata)])
    return groups, sources


async def test_each_task_is_scored_by_its_own_scorer_in_the_pool() -> None:
    """Several tasks and a composite, in the scorer's process pool: the task's own
    ``score_answer`` of the extracted answer, partial credit kept."""
    groups, expected = [], []
    for task in TASKS:
        metadata = item(task)
        dataset = reasoning_gym.create_dataset(task, size=8, seed=5)
        entry = dataset[0]
        gold = str(entry["answer"])
        texts = [answered(gold), answered("no idea"), "<think>never closed",
                 answered(gold + " and then some words")]
        groups.append([make_sample(text, metadata=metadata) for text in texts])
        expected.append([dataset.score_answer(gold, entry), dataset.score_answer("no idea", entry),
                         dataset.score_answer(None, entry),
                         dataset.score_answer(gold + " and then some words", entry)])
    mixed, sources = composite_groups()
    async with RewardBridge(bridge_config()) as bridge:
        scores = await bridge.score_batch([*groups, *mixed])
    for task, score, want in zip(TASKS, scores[:len(TASKS)], expected, strict=True):
        assert score.components["task"] == pytest.approx(want), task
        assert score.components["task"][0] == 1.0, task  # the gold answer, extracted
        assert score.components["task"][2] == 0.0, task  # unclosed trace: no answer
    partial = {task: s.components["task"][3] for task, s in zip(TASKS, scores, strict=False)}
    assert 0 < partial["leg_counting"] < 1 and 0 < partial["caesar_cipher"] < 1
    assert sources == {"basic_arithmetic", "leg_counting"}  # each item scored by its task
    assert [s.components["task"] for s in scores[len(TASKS):]] == [[1.0, 0.0]] * 6


async def test_a_scorer_that_raises_is_a_reward_error_never_a_zero() -> None:
    metadata = item("prime_factorization")
    group = [make_sample(answered("garbage ###"), metadata=metadata),
             make_sample(answered(str(metadata["answer"])), metadata=metadata)]
    async with RewardBridge(bridge_config(retries=0)) as bridge:
        with pytest.raises(ScoringError, match="ValueError") as failed:
            await bridge.score_group(group)
    assert failed.value.reason == "error" and failed.value.component == "task"
    async with RewardBridge(bridge_config(retries=0, on_error="skip_component",
                                          run_in="inline")) as bridge:
        result = await bridge.score_group(group)
    assert result.components["task"] == [None, 1.0]  # unknown, not wrong
    [flag] = result.flags
    assert (flag.component, flag.sample, flag.reason) == ("task", 0, "error")


async def test_metadata_reasoning_gym_refuses_is_bad_data() -> None:
    metadata = item("basic_arithmetic")
    metadata["reasoning_gym"]["config"] = {"size": 8, "no_such_field": 1}
    async with RewardBridge(bridge_config(retries=0, run_in="inline")) as bridge:
        with pytest.raises(ScoringError) as failed:
            await bridge.score_group([make_sample(answered("1"), metadata=metadata)])
    assert failed.value.reason == "bad_tests"  # dead-lettered reward_bad_data, not retried
    async with RewardBridge(bridge_config(run_in="inline")) as bridge:
        with pytest.raises(ScoringError, match="reasoning_gym") as missing:
            await bridge.score_group([make_sample(answered("1"), metadata={"answer": "1"})])
    assert missing.value.reason == "missing_field"


@pytest.mark.parametrize(("text", "how", "found"), [
    ("<answer> 4 </answer> then <answer>5</answer>", "answer_tag", "5"),
    ("no tags", "answer_tag", None),
    ("so \\boxed{\\frac{1}{2}} is it", "boxed", "\\frac{1}{2}"),
    ("\\boxed{open", "boxed", None),
    ("  42 \n", "none", "42"),
])
def test_answer_extraction(text: str, how: Any, found: str | None) -> None:
    assert extract_answer(text, how) == found


async def test_the_whole_region_and_boxed_answers_are_settings() -> None:
    metadata = item("basic_arithmetic")
    gold = str(metadata["answer"])
    unclosed = make_sample(f"<think>so \\boxed{{{gold}}}", metadata=metadata)
    async with RewardBridge(bridge_config(settings={"extract": "boxed"},
                                          run_in="inline")) as bridge:
        assert (await bridge.score_group([unclosed])).components["task"] == [0.0]
    async with RewardBridge(bridge_config(settings={"extract": "boxed", "answer_region": "whole"},
                                          run_in="inline")) as bridge:
        assert (await bridge.score_group([unclosed])).components["task"] == [1.0]
