"""The multi-turn bridge: masks, logprobs, one tokenisation per observation, versions."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest

from rollq.producers.envs import (
    EpisodeEnv,
    EpisodeRunner,
    GuessGame,
    StepResult,
    SyncEnvAdapter,
    TextTemplate,
    TruncatedTurn,
)
from rollq.producers.envs.observations import close_turn
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError
from tests.producers.fake_vllm import (
    EOS,
    IM_END,
    FakeVLLM,
    encode_text,
    fake_transport,
    logprob_of,
    render_chat,
)


def pool_of(fake: FakeVLLM) -> InferencePool:
    return InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                         health_interval_s=None)


def guesser(prompt: str, index: int) -> str:
    """Scripted model: binary search over the hints seen so far in the prompt."""
    low, high = 1, 16
    for guess, hint in re.findall(r"(\d+) is wrong: my number is (higher|lower)", prompt):
        if hint == "higher":
            low = max(low, int(guess) + 1)
        else:
            high = min(high, int(guess) - 1)
    return f"I guess {(low + high) // 2}"


class Versions:
    def __init__(self, *values: int) -> None:
        self.values = list(values)

    async def __call__(self) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


async def test_guess_episode_masks_env_tokens_and_keeps_server_logprobs() -> None:
    fake = FakeVLLM()
    fake.responder = guesser
    env = EpisodeEnv("guess", lambda: GuessGame(), size=100,
                     runner=EpisodeRunner(system_prompt="Play.", max_turns=6))
    seed = next(s for s in range(100) if random.Random(s).randint(1, 16) == 1)  # 4 turns
    async with pool_of(fake) as pool:
        rollout = await env.rollout(env.item(seed), pool, group_size=2,
                                    sampling=SamplingParams(max_tokens=16),
                                    policy_version=Versions(5))
    first = await GuessGame().reset(seed)
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": first}]
    assert rollout.prompt_ids == render_chat(messages, add_generation_prompt=True)
    assert rollout.metadata == {"seed": seed}
    completion = rollout.completions[0]
    assert completion.turn_rewards == [0.0, 0.0, 0.0, 1.0]
    assert completion.info["stop"] == "terminated"
    assert completion.token_versions is None and completion.policy_version == 5

    # Walk the sequence: each model turn is its text + EOS (mask 1, server logprobs), each
    # env turn is "\n" closing the assistant turn + the ChatML user turn (mask 0, logprob 0).
    ids, mask, logprobs = (completion.completion_ids.tolist(), completion.loss_mask.tolist(),
                           completion.logprobs.tolist())
    position = 0
    model_turns = [m["content"] for m in completion.messages or [] if m["role"] == "assistant"]
    observations = [m["content"] for m in completion.messages or [] if m["role"] == "user"]
    for turn, text in enumerate(model_turns):
        model_ids = [*encode_text(text), EOS]
        assert ids[position:position + len(model_ids)] == model_ids
        assert mask[position:position + len(model_ids)] == [1] * len(model_ids)
        assert logprobs[position:position + len(model_ids)] == pytest.approx(
            [logprob_of(t, 0) for t in model_ids], abs=1e-6)
        position += len(model_ids)
        if turn < len(observations):
            env_ids = [*encode_text("\n"), *render_chat(
                [{"role": "user", "content": observations[turn]}],
                add_generation_prompt=True)]
            assert ids[position:position + len(env_ids)] == env_ids
            assert mask[position:position + len(env_ids)] == [0] * len(env_ids)
            assert logprobs[position:position + len(env_ids)] == [0.0] * len(env_ids)
            position += len(env_ids)
    assert position == len(ids)
    # prompt tokenised once; then one /tokenize per observation per episode plus 2 probes
    assert fake.counts["/tokenize"] == 1 + 2 + 2 * 3
    # every turn sent the running token list as the prompt
    prompts = [body["prompt"] for path, body in fake.requests if path == "/v1/completions"]
    assert all(isinstance(p, list) and p[:len(rollout.prompt_ids)] == rollout.prompt_ids
               for p in prompts)


async def test_version_change_between_turns_sets_token_versions() -> None:
    fake = FakeVLLM()
    fake.responder = lambda prompt, index: "1"
    env = EpisodeEnv("guess", lambda: GuessGame(max_guesses=3), size=1,
                     runner=EpisodeRunner(max_turns=3))
    seed = next(s for s in range(100) if random.Random(s).randint(1, 16) > 1)
    async with pool_of(fake) as pool:
        completion = await env.runner.run(
            await _reset(GuessGame(max_guesses=3), seed), pool,
            await pool.tokenize(messages=[{"role": "user", "content": "go"}]),
            sampling=SamplingParams(), policy_version=Versions(4, 4, 6))
    assert completion.policy_version == 4
    assert completion.token_versions is not None
    versions = completion.token_versions.tolist()
    assert versions[0] == 4 and versions[-1] == 6
    model_versions = np.asarray(versions)[completion.loss_mask == 1]
    assert sorted(set(model_versions.tolist())) == [4, 6]
    assert completion.info["stop"] == "truncated" and completion.turn_rewards == [0.0] * 3


async def _reset(game: GuessGame, seed: int) -> GuessGame:
    await game.reset(seed)
    return game


async def test_budget_of_the_context_length_ends_the_episode() -> None:
    fake = FakeVLLM(max_model_len=160)
    fake.responder = lambda prompt, index: "7"
    env = EpisodeEnv("guess", lambda: GuessGame(max_guesses=50), size=1,
                     runner=EpisodeRunner(max_turns=50))
    async with pool_of(fake) as pool:
        rollout = await env.rollout(env.item(0), pool, group_size=1,
                                    sampling=SamplingParams(max_tokens=8),
                                    policy_version=Versions(0))
    completion = rollout.completions[0]
    assert len(rollout.prompt_ids) + len(completion.completion_ids) <= 160
    assert completion.info["stop"] == "max_tokens"


async def test_max_completion_tokens_and_max_turns() -> None:
    fake = FakeVLLM()
    fake.responder = lambda prompt, index: "7"
    async with pool_of(fake) as pool:
        short = EpisodeEnv("g", lambda: GuessGame(max_guesses=50), size=1,
                           runner=EpisodeRunner(max_turns=50, max_completion_tokens=40))
        rollout = await short.rollout(short.item(0), pool, group_size=1,
                                      sampling=SamplingParams(), policy_version=Versions(0))
        assert len(rollout.completions[0].completion_ids) <= 40
        two = EpisodeEnv("g", lambda: GuessGame(max_guesses=50), size=1,
                         runner=EpisodeRunner(max_turns=2))
        rollout = await two.rollout(two.item(0), pool, group_size=1,
                                    sampling=SamplingParams(), policy_version=Versions(0))
    completion = rollout.completions[0]
    assert completion.info["stop"] == "max_turns" and len(completion.turn_rewards) == 2
    assert completion.loss_mask[-1] == 1  # no dangling observation after the last turn


async def test_text_template_observations_and_length_cut_turns() -> None:
    fake = FakeVLLM()
    fake.responder = lambda prompt, index: "a long reply without a number"
    runner = EpisodeRunner(max_turns=2, observations=TextTemplate(
        "[user]{observation}[assistant]", turn_end="<E>"), truncated_turn="send")
    game = GuessGame()
    async with pool_of(fake) as pool:
        prompt_ids = await pool.tokenize(prompt="start")
        await game.reset(0)
        completion = await runner.run(game, pool, prompt_ids,
                                      sampling=SamplingParams(max_tokens=5),
                                      policy_version=Versions(0))
    ids = completion.completion_ids.tolist()
    assert ids[:5] == encode_text("a lon") and completion.finish_reason == "length"
    observation = "Please reply with a number between 1 and 16."
    env_ids = encode_text("<E>") + encode_text(f"[user]{observation}[assistant]")
    assert ids[5:5 + len(env_ids)] == env_ids


@pytest.mark.parametrize(("policy", "rewards"), [("end_episode", []),
                                                 ("end_with_penalty", [-0.5])])
async def test_a_length_cut_turn_ends_the_episode_unsent(policy: TruncatedTurn,
                                                         rewards: list[float]) -> None:
    fake = FakeVLLM()
    fake.responder = lambda prompt, index: "a long reply" if "wrong" in prompt else "7"
    steps: list[str] = []

    class Recording(GuessGame):
        async def step(self, action: str) -> StepResult:
            steps.append(action)
            return await super().step(action)

    game = Recording(max_guesses=9)
    runner = EpisodeRunner(max_turns=4, truncated_turn=policy, truncated_turn_penalty=-0.5)
    async with pool_of(fake) as pool:
        prompt_ids = await pool.tokenize(prompt="start")
        await game.reset(3)  # the secret is 8: the first turn ("7") is a wrong guess
        first = await runner.run(game, pool, prompt_ids, sampling=SamplingParams(max_tokens=5),
                                 policy_version=Versions(0))
        fake.responder = lambda prompt, index: "a long reply"
        await game.reset(3)
        steps.clear()
        cut = await runner.run(game, pool, prompt_ids, sampling=SamplingParams(max_tokens=5),
                               policy_version=Versions(0))
    assert first.info["stop"] == "truncated_turn" and first.info["turns"] == 2
    assert first.turn_rewards == [0.0, *rewards]
    assert first.info["env_return"] == sum(rewards) and first.finish_reason == "length"
    assert first.loss_mask[-1] == 1  # the cut reply stays, trainable; no observation after
    assert steps == [] and cut.info["turns"] == 1 and cut.turn_rewards == rewards
    with pytest.raises(ConfigError):
        EpisodeRunner(truncated_turn="drop")  # type: ignore[arg-type]


def test_close_turn_appends_only_what_the_model_did_not_emit() -> None:
    newline = encode_text("\n")
    turn_end = [IM_END, *newline]
    assert close_turn([5, IM_END], turn_end) == newline
    assert close_turn([5, IM_END, *newline], turn_end) == []
    assert close_turn([5, 6], turn_end) == turn_end
    assert close_turn([], turn_end) == turn_end


async def test_nondeterministic_reset_is_rejected() -> None:
    class Random:
        count = 0

        async def reset(self, seed: int) -> str:
            Random.count += 1
            return f"obs {Random.count}"

        async def step(self, action: str) -> StepResult:
            return "", 0.0, True, False, {}

    env = EpisodeEnv("r", Random, size=1)
    fake = FakeVLLM()
    async with pool_of(fake) as pool:
        with pytest.raises(ConfigError, match="not deterministic"):
            await env.rollout(env.item(0), pool, group_size=2, sampling=SamplingParams(),
                              policy_version=Versions(0))


async def test_sync_env_adapter_and_seeded_groups_differ() -> None:
    class Echo:
        def reset(self, seed: int) -> str:
            return "say something"

        def step(self, action: str) -> StepResult:
            info: dict[str, Any] = {"len": len(action)}
            return "", float(len(action)), True, False, info

    fake = FakeVLLM()
    env = EpisodeEnv("echo", lambda: SyncEnvAdapter(Echo(), in_thread=True), size=1)
    async with pool_of(fake) as pool:
        rollout = await env.rollout(env.item(0), pool, group_size=3,
                                    sampling=SamplingParams(seed=11),
                                    policy_version=Versions(0))
    texts = {c.text for c in rollout.completions}
    assert len(texts) == 3
    seeds = [body["seed"] for path, body in fake.requests if path == "/v1/completions"]
    assert sorted(seeds) == [11, 12, 13]
    assert all(c.info["env_info"]["len"] == len(c.text) for c in rollout.completions)
