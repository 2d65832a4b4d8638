"""Thin adapters from peer env interfaces to ``MultiTurnEnv``.

- gem (and gymnasium-style text envs): ``reset(seed) -> (observation, info)`` and
  ``step(action) -> (observation, reward, terminated, truncated, info)``; sync or async.
- SkyRL-gym ``BaseTextEnv``: ``init(prompt_messages) -> (prompt_messages, metadata)`` and
  ``step(action) -> {"observations": [messages], "reward", "done", "metadata"}``. The env
  is built per item (its constructor takes the dataset row), so the adapter takes the
  initial conversation and ignores the seed. AReaL's multi-turn agents are workflows that
  call the model themselves; the step-level part of one (a reward/feedback function of the
  model's reply) fits ``MultiTurnEnv`` directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Protocol

from rollq.producers.envs.multiturn import StepResult
from rollq.producers.envs.observations import Observation
from rollq.producers.inference import MessageDict


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class GemStyleEnv(Protocol):
    def reset(self, seed: int | None = None) -> Any: ...

    def step(self, action: str) -> Any: ...


class GemAdapter:
    """``MultiTurnEnv`` over a gem/gymnasium-style env (sync or async methods)."""

    def __init__(self, env: GemStyleEnv) -> None:
        self.env = env
        self.reset_info: dict[str, Any] = {}

    async def reset(self, seed: int) -> Observation:
        observation, info = await _resolve(self.env.reset(seed=seed))
        self.reset_info = dict(info or {})
        return _observation(observation)

    async def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = await _resolve(self.env.step(action))
        return (_observation(observation), float(reward), bool(terminated), bool(truncated),
                dict(info or {}))


class SkyRLStyleEnv(Protocol):
    def init(self, prompt: list[MessageDict]) -> Any: ...

    def step(self, action: str) -> Any: ...


class SkyRLGymAdapter:
    """``MultiTurnEnv`` over a SkyRL-gym-style text env built for one item."""

    def __init__(self, env: SkyRLStyleEnv, prompt: list[MessageDict]) -> None:
        self.env, self.prompt = env, prompt

    async def reset(self, seed: int) -> Observation:
        messages, _metadata = await _resolve(self.env.init(list(self.prompt)))
        return list(messages)

    async def step(self, action: str) -> StepResult:
        output: Mapping[str, Any] = await _resolve(self.env.step(action))
        observations = list(output.get("observations") or [])
        done = bool(output.get("done"))
        return (observations or "", float(output.get("reward") or 0.0), done, False,
                dict(output.get("metadata") or {}))


def _observation(value: Any) -> Observation:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(message, dict) for message in value):
        return value
    return str(value)
