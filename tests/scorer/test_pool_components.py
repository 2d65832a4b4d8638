"""Every built-in component runs in the process pool exactly as it runs inline.

Samples and components cross the pool boundary by pickle; a component (or a sample field)
that does not pickle would fail every pooled call. One bridge runs every registry
component with ``run_in: process``, another with ``run_in: inline``, on the same groups.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from rollq.consumers.scorer import COMPONENTS, GroupScore, RewardBridge, RewardConfig, Sample
from tests.scorer.helpers import make_sample

SETTINGS: dict[str, dict[str, Any]] = {
    "format": {"preset": "r1"},
    "soft_overlong": {"max_completion_len": 60, "cache": 30},
    "process": {"aggregate": "mean", "placement": "spread"},
}
"""Settings for the components that need some; the others run with their defaults."""

TEXTS = [
    "<think>\nFirst, halve it.\n\nStep 2: so 1/2\n</think>\n<answer>\n$\\frac{1}{2}$\n</answer>",
    "<think>\nthe the the the the the\n\nhmm 3\n</think>\n<answer>\n$\\frac{1}{3}$\n</answer>",
    "<think>a\n\nb</think>The answer is $\\frac{1}{2}$ 12345",
]
LABELS = [[1, 0], [0, 1], [1, 1]]


def groups() -> list[list[Sample]]:
    """Two groups; the second's metadata are read-only mappings, which do not pickle:
    the bridge hands the pool plain dicts."""
    gold = {"answer": "$\\frac{1}{2}$", "tests": [{"input": "", "output": "1/2"}],
            "reasoning_gym": {"dataset": "basic_arithmetic", "config": {"size": 2, "seed": 0},
                              "index": 0, "entry": {"question": "Half of 1?", "answer": "1/2",
                                                    "metadata": {}}}}
    first, second = ([make_sample(text, tokens=10 + 7 * i + offset, metadata=gold,
                                  completion_metadata={"step_labels": labels,
                                                       "env_score": 0.25 * i,
                                                       "env_return": 1.5 - i})
                      for i, (text, labels) in enumerate(zip(TEXTS, LABELS, strict=True))]
                     for offset in (0, 40))
    second = [replace(sample, metadata=MappingProxyType(dict(sample.metadata)),
                      completion_metadata=MappingProxyType(dict(sample.completion_metadata)))
              for sample in second]
    return [first, second]


def config(run_in: str) -> RewardConfig:
    entries = [{"name": name, "component": name, "run_in": run_in,
                "settings": SETTINGS.get(name, {})} for name in COMPONENTS]
    # The batch-scoped variant ships the whole batch to the pool with each call.
    entries.append({"name": "length_batch", "component": "length", "run_in": run_in,
                    "settings": {"scope": "batch"}})
    return RewardConfig.from_mapping({"components": entries, "pool": {"workers": 2},
                                      "advantages": {"zero_variance": "keep"}})


async def score(run_in: str) -> list[GroupScore]:
    async with RewardBridge(config(run_in)) as bridge:
        assert (bridge._pool is not None) == (run_in == "process")
        return await bridge.score_batch(groups())


async def test_every_builtin_component_scores_the_same_in_the_pool() -> None:
    pooled, inline = await score("process"), await score("inline")
    for in_pool, on_loop in zip(pooled, inline, strict=True):
        assert in_pool.flags == () and on_loop.flags == ()
        assert set(in_pool.components) == {*COMPONENTS, "length_batch"}
        for name in in_pool.components:
            assert in_pool.components[name] == pytest.approx(on_loop.components[name]), name
        assert in_pool.rewards == pytest.approx(on_loop.rewards)
        assert in_pool.token_rewards is not None and on_loop.token_rewards is not None
        for a, b in zip(in_pool.token_rewards, on_loop.token_rewards, strict=True):
            np.testing.assert_allclose(a, b)
    # Every component really scored something (a new one needing settings or metadata
    # that this test lacks would be all None): add them to SETTINGS / groups().
    for name, values in pooled[0].components.items():
        assert any(value is not None for value in values), name
    # The samples really were scored (not all skipped or equal): accuracy tells them apart.
    assert pooled[0].components["accuracy"] == [1.0, 0.0, 1.0]
    assert pooled[0].components["process"] == [0.5, 0.5, 1.0]


async def test_default_metadata_of_a_bridge_sample_pickles() -> None:
    """`make_sample` without metadata: plain dicts, so a pooled component can score it."""
    cfg = RewardConfig.from_mapping({"components": [
        {"name": "tags", "component": "tag_count", "run_in": "process"}], "pool": {"workers": 1}})
    async with RewardBridge(cfg) as bridge:
        samples = [bridge.make_sample(text, [1, 2, 3]) for text in TEXTS]
        result = await bridge.score_group(samples)
    assert result.flags == () and result.components["tags"] == [1.0, 1.0, 0.0]
