"""The `env_return` component: a multi-turn episode's return, read from the completion's
info (the bridge's `env_return`); skipped, never zero, when there is none."""

from __future__ import annotations

import math

import pytest

from rollq.consumers.scorer.components import COMPONENTS, EnvReturn, resolve_component
from rollq.consumers.scorer.components.env_return import EnvReturnSettings
from tests.scorer.helpers import make_sample


@pytest.mark.parametrize(("info", "expected"), [
    ({"env_return": 0.75, "env_score": 9.0}, 0.75),
    ({"env_return": -1}, -1.0),
    ({}, None),  # not a multi-turn episode: skipped, not scored 0
    ({"env_return": math.nan}, None),
    ({"env_return": True}, None),
    ({"env_return": "1.0"}, None),
])
def test_env_return_reads_the_episode_return(info: dict[str, object],
                                             expected: float | None) -> None:
    component = EnvReturn(EnvReturnSettings())
    assert component.score(make_sample("x", completion_metadata=info), []) == expected


def test_env_return_is_built_in_and_its_field_configurable() -> None:
    assert resolve_component("env_return") is EnvReturn and COMPONENTS["env_return"] is EnvReturn
    component = EnvReturn(EnvReturnSettings(field="game_return"))
    sample = make_sample("x", metadata={"game_return": 2.0})  # per-group metadata too
    assert component.score(sample, []) == 2.0
