"""Process rewards: segmentation, token placement, aggregation, and a PRM over HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest

from rollq.consumers.scorer import Sample, ScoringError
from rollq.consumers.scorer.components import ProcessReward, ProcessSettings
from tests.scorer.helpers import make_sample

# One token per char (make_sample's default), so token indices equal char positions.
TEXT = "<think>ab\n\ncd</think>x"  # steps "ab" at chars 7-8 and "cd" at 11-12


def process(**settings: Any) -> ProcessReward:
    return ProcessReward(ProcessSettings.model_validate(settings))


def steps_text(component: ProcessReward, sample: Sample) -> list[str]:
    text = sample.full_text()
    return [text[start:end] for start, end in component.steps(sample)]


@pytest.mark.parametrize(("settings", "text", "metadata", "expected"), [
    ({}, "<think>a b\n\n c d \n \n\ne</think>ans", {}, ["a b", "c d", "e"]),
    ({}, "<think>one</think>mid<think>two\n\nthree</think>", {}, ["one", "two", "three"]),
    ({}, "no tags\n\nat all", {}, []),
    ({"region": "anywhere"}, "no tags\n\nat all", {}, ["no tags", "at all"]),
    ({"segmenter": "step_markers"}, "<think>intro Step 1: x. Step 2: y.</think>z", {},
     ["Step 1: x.", "Step 2: y."]),
    ({"segmenter": "env_spans"}, "abcdefgh", {"step_spans": [[0, 3], [4, 8]]},
     ["abc", "efgh"]),
])
def test_segmenters(settings: dict[str, Any], text: str, metadata: dict[str, Any],
                    expected: list[str]) -> None:
    component = process(**settings)
    sample = make_sample(text, completion_metadata=metadata)
    assert steps_text(component, sample) == expected


def test_server_field_reasoning_is_segmented() -> None:
    sample = make_sample("answer 4", reasoning="first\n\nsecond")
    assert steps_text(process(), sample) == ["first", "second"]


@pytest.mark.parametrize(("placement", "expected"), [
    ("last_token", {8: 1.0, 12: 0.5}),
    ("spread", {7: 0.5, 8: 0.5, 11: 0.25, 12: 0.25}),
])
def test_placement_on_tokens(placement: str, expected: dict[int, float]) -> None:
    sample = make_sample(TEXT, completion_metadata={"step_labels": [1, 0.5]})
    score = process(placement=placement).evaluate(sample, [sample])
    assert score.token_rewards is not None
    assert len(score.token_rewards) == len(TEXT)
    want = np.zeros(len(TEXT), dtype=np.float32)
    for index, value in expected.items():
        want[index] = value
    np.testing.assert_allclose(score.token_rewards, want)
    assert score.step_ends is not None and score.step_ends.tolist() == [8, 12]


@pytest.mark.parametrize(("aggregate", "expected"), [("min", 0.5), ("mean", 0.75),
                                                     ("last", 0.5)])
def test_aggregate(aggregate: str, expected: float) -> None:
    sample = make_sample(TEXT, metadata={"step_labels": [1, 0.5]})
    assert process(aggregate=aggregate).score(sample, [sample]) == expected


def test_token_offsets_map_steps_exactly() -> None:
    base = make_sample(TEXT, ids=[10, 11, 12, 13, 14], completion_metadata={
        "step_labels": [1, 0]})
    # Tokens start at chars 0, 7, 9, 11, 13: "ab" is token 1, "cd" token 3.
    sample = Sample(**{**base.__dict__, "token_offsets": np.array([0, 7, 9, 11, 13])})
    score = process().evaluate(sample, [sample])
    assert score.token_rewards is not None
    assert score.token_rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert score.step_ends is not None and score.step_ends.tolist() == [1, 3]


def test_no_steps_is_skipped_and_label_mismatch_raises() -> None:
    empty = make_sample("no reasoning", metadata={"step_labels": []})
    score = process().evaluate(empty, [empty])
    assert score.value is None
    assert score.token_rewards is not None and not score.token_rewards.any()
    mismatched = make_sample(TEXT, metadata={"step_labels": [1]})
    with pytest.raises(ValueError, match="1 step labels for 2 steps"):
        process().evaluate(mismatched, [mismatched])


def test_prm_settings_required_for_prm_source() -> None:
    with pytest.raises(ValueError, match="prm"):
        ProcessSettings(source="prm")


def prm_transport(seen: list[dict[str, Any]], status: int = 200) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(status, json={"scores": [0.1 * len(s) for s in body["steps"]]})
    return httpx.MockTransport(handle)


async def test_prm_over_http() -> None:
    seen: list[dict[str, Any]] = []
    component = process(source="prm", prm={"url": "http://prm.test/score"}, aggregate="mean")
    assert component.placement == "async"
    await component.open(transport=prm_transport(seen))
    try:
        sample = make_sample("<think>ab\n\ncdef</think>x", prompt="What?")
        score = await component.evaluate_async(sample, [sample])
    finally:
        await component.close()
    assert seen == [{"prompt": "What?", "steps": ["ab", "cdef"]}]
    assert score.value == pytest.approx(0.3)
    assert score.step_scores is not None
    np.testing.assert_allclose(score.step_scores, [0.2, 0.4])


async def test_prm_http_error_is_a_reward_error() -> None:
    component = process(source="prm", prm={"url": "http://prm.test/score"})
    await component.open(transport=prm_transport([], status=503))
    try:
        sample = make_sample(TEXT)
        with pytest.raises(ScoringError, match="503") as caught:
            await component.evaluate_async(sample, [sample])
    finally:
        await component.close()
    assert caught.value.reason == "prm_error"
