"""Peer env adapters (gem, SkyRL-gym) and the env registry."""

from __future__ import annotations

from typing import Any

import pytest

from rollq.producers.envs import (
    DatasetEnv,
    Env,
    EpisodeEnv,
    EpisodeRunner,
    GemAdapter,
    SkyRLGymAdapter,
    make_env,
)
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError
from tests.producers.fake_vllm import FakeVLLM, fake_transport


class CountdownGem:
    """A gem-shaped env: reset -> (obs, info); step -> 5-tuple; sync methods."""

    def __init__(self) -> None:
        self.left = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.left = 2 + (seed or 0) % 2
        return f"count down from {self.left}", {"start": self.left}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        return str(self.left), 0.5, self.left == 0, False, {"left": self.left}


class AsyncSkyRL:
    """A SkyRL-gym-shaped env: init(messages) and step -> dict with chat observations."""

    def __init__(self) -> None:
        self.turns = 0

    async def init(self, prompt: list[dict[str, Any]]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    async def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        done = self.turns == 2
        observations = [] if done else [{"role": "tool", "content": "result: 42"}]
        return {"observations": observations, "reward": 1.0 if done else 0.0, "done": done,
                "metadata": {"turns": self.turns}}


async def test_gem_adapter_plays_through_the_bridge() -> None:
    adapter = GemAdapter(CountdownGem())
    assert await adapter.reset(1) == "count down from 3" and adapter.reset_info == {"start": 3}
    assert await adapter.step("x") == ("2", 0.5, False, False, {"left": 2})
    fake = FakeVLLM()
    env = EpisodeEnv("countdown", lambda: GemAdapter(CountdownGem()), size=4)
    async with InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        rollout = await env.rollout(env.item(1), pool, group_size=2,
                                    sampling=SamplingParams(), policy_version=_zero)
    assert [c.turn_rewards for c in rollout.completions] == [[0.5] * 3] * 2


async def test_skyrl_adapter_uses_chat_observations() -> None:
    prompt = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "go"}]
    fake = FakeVLLM()
    env = EpisodeEnv("skyrl", lambda: SkyRLGymAdapter(AsyncSkyRL(), prompt), size=1,
                     runner=EpisodeRunner())
    async with InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        rollout = await env.rollout(env.item(0), pool, group_size=1,
                                    sampling=SamplingParams(), policy_version=_zero)
    assert rollout.prompt_messages == prompt
    completion = rollout.completions[0]
    assert completion.turn_rewards == [0.0, 1.0]
    assert completion.messages is not None
    assert [m["role"] for m in completion.messages] == ["assistant", "tool", "assistant"]


async def _zero() -> int:
    return 0


def test_registry_builds_the_builtins() -> None:
    gsm8k = make_env("gsm8k")
    assert isinstance(gsm8k, DatasetEnv) and len(gsm8k) == 200 and gsm8k.name == "gsm8k"
    styled = make_env("gsm8k", mode="completion", template="Q: {question}\nA:")
    assert isinstance(styled, DatasetEnv) and styled.style.mode == "completion"
    guess = make_env("guess", high=8, size=10)
    assert isinstance(guess, EpisodeEnv) and len(guess) == 10
    assert isinstance(guess, Env) and isinstance(gsm8k, Env)


def test_registry_errors_name_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"\['gsm8k', 'guess', 'math', 'sums', 'tools'\]"):
        make_env("nope")
    with pytest.raises(ConfigError, match="source"):
        make_env("math")
    with pytest.raises(ConfigError, match="bad options"):
        make_env("guess", colour="red")
    with pytest.raises(ConfigError, match="cannot load"):
        make_env("no.such.module:thing")


def build_echo(size: int = 3) -> EpisodeEnv:
    """A user env factory, loaded by dotted path in the test below."""
    return EpisodeEnv("echo", lambda: GemAdapter(CountdownGem()), size=size)


def not_an_env() -> int:
    return 1


def test_registry_loads_dotted_paths() -> None:
    env = make_env("tests.producers.test_adapters_registry:build_echo", size=5)
    assert len(env) == 5
    with pytest.raises(ConfigError, match="did not produce an Env"):
        make_env("tests.producers.test_adapters_registry:not_an_env")
