"""Multi-turn envs: a gymnasium-style protocol and the bridge that runs it token-in/token-out.

``MultiTurnEnv`` is async: ``reset(seed) -> observation`` and ``step(action_text) ->
(observation, reward, terminated, truncated, info)``. Sync envs plug in through
``SyncEnvAdapter``; peer interfaces (gem, SkyRL-gym) through ``producers.envs.adapters``.

The bridge (``EpisodeRunner``) runs one episode against the model without ever
re-tokenising model output:

1. the prompt ``[system?] + reset observation`` is tokenised once per group by the server's
   ``/tokenize`` (chat template, generation prompt);
2. each turn sends ``prompt_ids + completion_ids so far`` as a token-id prompt to
   ``/v1/completions`` (n=1) and appends the returned ids with loss mask 1 and the server's
   logprobs;
3. the model's text goes to ``env.step``; its reward is kept in ``turn_rewards``;
4. unless the episode ended, the observation is tokenised once by an ``ObservationEncoder``
   (``producers.envs.observations``) and appended with mask 0 and logprob 0.0.

It stops on ``terminated``/``truncated``, after ``max_turns`` model turns, or when the
token budget is spent: ``max_completion_tokens`` over the episode, and the server's context
length (prompt + completion <= ``max_model_len``). ``SamplingParams.max_tokens`` bounds
each turn. ``EpisodeEnv`` makes an ``Env`` of it: a group is N independent episodes from the
same ``reset(seed)`` (same prompt ids), run concurrently; ``RecordEpisodeEnv`` does the same
over a dataset whose rows build the env (SkyRL-gym).

**A turn cut short** (the server's ``finish_reason`` is ``length``: the turn's
``max_tokens``, the episode's budget or the context ran out mid-reply) follows
``truncated_turn``:

- ``end_episode`` (default): the episode ends there and the unfinished reply is not sent to
  the env. Its tokens stay in the sequence (trainable, ``finish_reason`` ``length``,
  ``info["stop"]`` ``truncated_turn``), so length-aware rewards (``soft_overlong``) or a
  trainer's overlong filter can see it; the env is never asked to judge text the model did
  not finish (gem scores a cut ``\\boxed{`` as a format error, or acts on a half-written
  action).
- ``end_with_penalty``: the same, and ``truncated_turn_penalty`` is the turn's reward (so it
  counts in the episode's return).
- ``send``: the reply goes to the env as it is (the behaviour before this setting).

``Completion.info`` of an episode: ``turns`` (model turns), ``stop`` (``terminated``,
``truncated``, ``max_turns``, ``max_tokens`` or ``truncated_turn``), ``env_info`` (the last
step's info), and ``env_return``: the undiscounted sum of the turn rewards (what the
``env_return`` reward component scores); the rewards one by one are
``Completion.turn_rewards``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rollq.producers.envs.base import Item, PolicyVersion, RecordItems, Rollout
from rollq.producers.envs.observations import (
    ChatTemplateDelta,
    Observation,
    ObservationEncoder,
    as_messages,
    observation_text,
)
from rollq.producers.inference import InferencePool, MessageDict, PromptTooLongError, SamplingParams
from rollq.schemas import Completion, ConfigError, ContractError, SamplingRecord

StepResult = tuple[Observation, float, bool, bool, dict[str, Any]]
"""``(observation, reward, terminated, truncated, info)``, as in gymnasium."""

TruncatedTurn = Literal["end_episode", "end_with_penalty", "send"]
"""What the bridge does with a turn cut short by a token limit (module docstring)."""


class MultiTurnEnv(Protocol):
    """A text env played over several model turns. One instance plays one episode at a
    time; ``reset`` with the same seed must give the same first observation."""

    async def reset(self, seed: int) -> Observation: ...

    async def step(self, action: str) -> StepResult: ...


class SyncMultiTurnEnv(Protocol):
    """The same protocol with plain (blocking) methods."""

    def reset(self, seed: int) -> Observation: ...

    def step(self, action: str) -> StepResult: ...


@dataclass
class SyncEnvAdapter:
    """A ``MultiTurnEnv`` over a sync env; ``in_thread`` runs its calls in a worker thread
    (for envs that block on I/O or compute)."""

    env: SyncMultiTurnEnv
    in_thread: bool = False

    async def reset(self, seed: int) -> Observation:
        if self.in_thread:
            return await asyncio.to_thread(self.env.reset, seed)
        return self.env.reset(seed)

    async def step(self, action: str) -> StepResult:
        if self.in_thread:
            return await asyncio.to_thread(self.env.step, action)
        return self.env.step(action)


@dataclass
class EpisodeRunner:
    """Runs episodes token-in/token-out (see the module docstring).

    - ``system_prompt``: prepended to the reset observation; None for none.
    - ``observations``: how observations become tokens (chat-template delta by default).
    - ``max_turns``: most model turns per episode.
    - ``max_completion_tokens``: most tokens after the prompt (model and env), None for
      only the context length.
    - ``truncated_turn``: the policy for a turn cut short by a token limit (module
      docstring); ``truncated_turn_penalty``: that turn's reward under ``end_with_penalty``
      (in the env's reward units).
    """

    system_prompt: str | None = None
    observations: ObservationEncoder = field(default_factory=ChatTemplateDelta)
    max_turns: int = 8
    max_completion_tokens: int | None = None
    truncated_turn: TruncatedTurn = "end_episode"
    truncated_turn_penalty: float = -1.0

    def __post_init__(self) -> None:
        if self.truncated_turn not in ("end_episode", "end_with_penalty", "send"):
            raise ConfigError(f"truncated_turn {self.truncated_turn!r}: choose end_episode, "
                              "end_with_penalty or send")
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1 (got {self.max_turns})")

    def prompt_messages(self, observation: Observation) -> list[MessageDict]:
        """The chat prompt of an episode starting with ``observation``."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, *as_messages(observation)]

    def _budget(self, max_model_len: int | None, prompt_len: int) -> int | None:
        """Most tokens after the prompt, None when unbounded."""
        limits = [limit for limit in (
            None if max_model_len is None else max_model_len - prompt_len,
            self.max_completion_tokens) if limit is not None]
        return min(limits) if limits else None

    async def run(self, env: MultiTurnEnv, pool: InferencePool, prompt_ids: list[int], *,
                  sampling: SamplingParams, policy_version: PolicyVersion) -> Completion:
        """Play one episode of an env that was just reset; returns its completion."""
        budget = self._budget((await pool.model_info()).max_model_len, len(prompt_ids))
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        rewards: list[float] = []
        messages: list[MessageDict] = []
        texts: list[str] = []
        finish_reason, stop, turns = "", "max_turns", 0
        info: dict[str, Any] = {}
        sampled: SamplingRecord | None = None  # the first turn's (they share their settings)
        for turn in range(self.max_turns):
            room = [r for r in (None if budget is None else budget - len(ids),
                                sampling.max_tokens) if r is not None]
            if room and min(room) <= 0:
                stop = "max_tokens"
                break
            version = await policy_version()
            params = sampling.with_max_tokens(min(room)) if room else sampling
            try:
                [sample] = await pool.complete([*prompt_ids, *ids], n=1, params=params)
            except PromptTooLongError:
                if turn == 0:
                    raise
                stop = "max_tokens"
                break
            turns += 1
            sampled = sampled or sample.sampling
            ids += sample.completion_ids
            logprobs += sample.logprobs
            mask += [1] * len(sample.completion_ids)
            versions += sample.versions(version)  # the server's labels, where it gives them
            finish_reason = sample.finish_reason
            messages.append({"role": "assistant", "content": sample.text})
            texts.append(sample.text)
            if sample.finish_reason == "length" and self.truncated_turn != "send":
                if self.truncated_turn == "end_with_penalty":
                    rewards.append(self.truncated_turn_penalty)
                stop = "truncated_turn"
                break
            observation, reward, terminated, truncated, info = await env.step(sample.text)
            rewards.append(float(reward))
            if terminated or truncated:
                stop = "terminated" if terminated else "truncated"
                break
            if turn + 1 == self.max_turns:
                break
            env_ids = await self.observations.encode(pool, observation, sample.completion_ids)
            if budget is not None and len(ids) + len(env_ids) >= budget:
                # no room left for a model token after the observation: end here
                stop = "max_tokens"
                break
            ids += env_ids
            logprobs += [0.0] * len(env_ids)
            mask += [0] * len(env_ids)
            versions += [version] * len(env_ids)
            messages += as_messages(observation)
            texts.append(observation_text(observation))
        if not ids:
            raise ContractError("episode produced no tokens: the prompt fills the context")
        return Completion(
            completion_ids=ids, logprobs=logprobs, loss_mask=mask,
            policy_version=versions[0],
            token_versions=versions if len(set(versions)) > 1 else None,
            finish_reason=finish_reason, text="\n".join(texts), messages=messages,
            turn_rewards=rewards, sampling=sampled,
            info={"turns": turns, "stop": stop, "env_info": info,
                  "env_return": sum(rewards)},
        )


@dataclass
class EpisodeEnv:
    """An ``Env`` of multi-turn episodes: item ``i`` is ``reset(seed=first_seed + i)``.

    ``make_env`` builds a fresh ``MultiTurnEnv`` per episode. With ``sampling.seed`` set,
    episode ``j`` of a group samples with ``seed + j`` so the group's episodes differ.
    """

    name: str
    make_env: Callable[[], MultiTurnEnv]
    size: int = 1000
    first_seed: int = 0
    runner: EpisodeRunner = field(default_factory=EpisodeRunner)

    def __len__(self) -> int:
        return self.size

    def item(self, index: int) -> Item:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return Item(index=index, fields={"seed": self.first_seed + index})

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        seed = int(item.fields["seed"])
        return await play_group(self.name, self.runner, [self.make_env() for _ in range(
            group_size)], seed, pool, sampling=sampling, policy_version=policy_version)


@dataclass
class RecordEpisodeEnv(RecordItems):
    """An ``Env`` of multi-turn episodes over a dataset: item ``i`` is ``records[i]``.

    ``make_env(record)`` builds a fresh ``MultiTurnEnv`` per episode from the item's row
    (SkyRL-gym envs take their task that way); every episode is reset with ``seed=i``.
    """

    name: str
    records: Sequence[dict[str, Any]]
    make_env: Callable[[dict[str, Any]], MultiTurnEnv]
    runner: EpisodeRunner = field(default_factory=EpisodeRunner)

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        envs = [self.make_env(dict(item.fields)) for _ in range(group_size)]
        return await play_group(self.name, self.runner, envs, item.index, pool,
                                sampling=sampling, policy_version=policy_version)


async def play_group(name: str, runner: EpisodeRunner, envs: list[MultiTurnEnv], seed: int,
                     pool: InferencePool, *, sampling: SamplingParams,
                     policy_version: PolicyVersion) -> Rollout:
    """One group: every env reset with ``seed`` (they must agree), then one episode each,
    concurrently; episode ``j`` samples with ``sampling.seed + j`` when a seed is set."""
    observations = [await env.reset(seed) for env in envs]
    if any(observation != observations[0] for observation in observations):
        raise ConfigError(f"env {name!r}: reset(seed={seed}) is not deterministic")
    messages = runner.prompt_messages(observations[0])
    prompt_ids = await pool.tokenize(messages=messages, add_generation_prompt=True)
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(runner.run(
            env, pool, prompt_ids, policy_version=policy_version,
            sampling=sampling if sampling.seed is None else
            sampling.model_copy(update={"seed": sampling.seed + episode})))
            for episode, env in enumerate(envs)]
    return Rollout(prompt_ids=prompt_ids, completions=[task.result() for task in tasks],
                   prompt_text=observation_text(observations[0]),
                   prompt_messages=messages, metadata={"seed": seed})
