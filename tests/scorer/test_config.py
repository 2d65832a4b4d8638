"""Reward configuration: loading, presets, and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollq.consumers.scorer import RewardConfig, RewardConfigError

YAML = """\
preset: r1
components:
  - name: accuracy
    settings: {gold_field: solution, on_unparseable_gold: zero}
  - name: overlong
    component: soft_overlong
    weight: 0.5
    settings: {max_completion_len: 4096, cache: 512}
    on_error: skip_component
    retries: 2
    timeout_s: 5
advantages: {method: rloo, zero_variance: keep}
trace: {open_tag: "<reasoning>", close_tag: "</reasoning>"}
pool: {workers: 3}
"""


def test_from_yaml_merges_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "reward.yaml"
    path.write_text(YAML)
    config = RewardConfig.from_yaml(path)
    entries = {entry.name: entry for entry in config.components}
    assert list(entries) == ["accuracy", "format", "tag_count", "overlong"]
    assert entries["accuracy"].component == "accuracy"
    assert entries["accuracy"].settings == {"gold_field": "solution",
                                            "on_unparseable_gold": "zero"}
    assert entries["format"].settings == {"preset": "r1"}
    assert entries["overlong"].weight == 0.5
    assert entries["overlong"].on_error == "skip_component"
    assert entries["overlong"].retries == 2
    assert (entries["format"].on_error, entries["format"].retries) == ("dead_letter", 1)
    assert config.advantages.method == "rloo"
    assert config.trace.open_tag == "<reasoning>"
    assert config.pool.workers == 3
    assert config.correctness_name() == "accuracy"
    assert config.combine == "weighted_sum"


def test_roll_universal_preset() -> None:
    config = RewardConfig.from_mapping({"preset": "roll_universal"})
    assert config.combine == "roll_universal"
    assert [e.name for e in config.components] == ["accuracy", "format_markers",
                                                   "length_bounty"]


@pytest.mark.parametrize(("data", "names"), [
    ({"components": [{"name": "x", "component": "nonsense"}]},
     ["components.0.component", "unknown component 'nonsense'"]),
    ({"components": [{"name": "r", "component": "repetition",
                      "settings": {"max_penalty": 1.0}}]},
     ["components.0", "settings.max_penalty", "must be ≤ 0"]),
    ({"components": [{"name": "a", "component": "accuracy", "wieght": 2}]},
     ["components.0.wieght", "Extra inputs"]),
    ({"components": [{"name": "a", "component": "accuracy",
                      "settings": {"gold_feild": "x"}}]},
     ["settings.gold_feild"]),
    ({"components": [{"name": "c", "component": "cosine"}]}, ["correctness"]),
    ({"components": [{"name": "a", "component": "accuracy"}], "correctness": "b"},
     ["correctness", "'b'"]),
    ({"components": [{"name": "a", "component": "tag_count"},
                     {"name": "a", "component": "format", "settings": {"preset": "r1"}}]},
     ["duplicate", "'a'"]),
    ({"components": []}, ["components"]),
    ({"components": [{"name": "a", "component": "tag_count"}],
      "advantages": {"process_component": "a"}}, ["advantages.process_component"]),
    ({"components": [{"name": "a", "component": "tag_count"}],
      "advantages": {"method": "ppo"}}, ["advantages.method"]),
    ({"components": [{"name": "x", "component": "no.such.module:Thing"}]},
     ["components.0.component", "no.such.module:Thing"]),
    ({"preset": "r2"}, ["preset"]),
    ({"components": [{"name": "a", "component": "tag_count", "on_error": "zero"}]},
     ["components.0.on_error", "'zero' is no longer accepted", "skip_component",
      "dead_letter"]),
    ({"components": [{"name": "a", "component": "tag_count", "retries": -1}]},
     ["components.0.retries"]),
    ({"preset": "roll_universal",
      "components": [{"name": "accuracy", "on_error": "skip_component"}]},
     ["components.accuracy.on_error", "roll_universal"]),
])
def test_config_errors_name_the_field(data: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(RewardConfigError) as caught:
        RewardConfig.from_mapping(data)
    for name in names:
        assert name in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "reward.yaml"
    path.write_text("- just a list\n")
    with pytest.raises(RewardConfigError, match="mapping"):
        RewardConfig.from_yaml(path)
    with pytest.raises(RewardConfigError, match="cannot read"):
        RewardConfig.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("component", ["format", "reasoning_steps", "char_fraction"])
def test_a_regex_that_does_not_compile_is_a_config_error(component: str) -> None:
    with pytest.raises(RewardConfigError, match=r"settings\.pattern: invalid regex '\('"):
        RewardConfig.from_mapping(
            {"components": [{"name": "x", "component": component, "settings": {"pattern": "("}}]})
