"""The episode API on the fake server: capture, merging, token-in, multi-sequence episodes."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest

from rollq.producers.envs.base import Item
from rollq.producers.envs.episode import ClientEpisodeEnv
from rollq.producers.envs.registry import make_env
from rollq.producers.inference import InferenceRequestError, SamplingParams
from rollq.producers.inference.capture import (
    CapturedCall,
    EpisodeCapture,
    EpisodeClient,
    Upstream,
    assemble_sequences,
)
from rollq.producers.inference.capture.replies import ChatCompletion, TextCompletion
from rollq.schemas import ContractError, InferenceUnavailable
from tests.agents.agents import CalculatorEnv, RewritingEnv, TextEnv
from tests.agents.fake_agent_vllm import PAIR, AgentFakeVLLM, decode
from tests.agents.helpers import assert_exactly_served, pool_of, served, tool_script

SAMPLING = SamplingParams(temperature=1.0, max_tokens=64)


async def zero() -> int:
    return 0


async def rollout(env: Any, fake: AgentFakeVLLM, group_size: int = 2) -> Any:
    async with pool_of(fake) as pool:
        return await ClientEpisodeEnv(env).rollout(env.item(0), pool, group_size=group_size,
                                                   sampling=SAMPLING, policy_version=zero)


def call(index: int, prompt: list[int], completion: list[int]) -> CapturedCall:
    return CapturedCall(index=index, route="completions", request={}, prompt_ids=prompt,
                        completion_ids=completion, logprobs=[-0.5] * len(completion),
                        finish_reason="stop", text="", message=None, policy_version=index)


def test_calls_extending_a_sequence_merge_with_env_tokens_masked() -> None:
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 3, 4, 9, 9], [5]),
             call(2, [7], [8]),  # does not extend: a new sequence
             call(3, [1, 2, 3, 4, 9, 9, 5, 6], [10])]  # extends the first again
    first, second = assemble_sequences(calls)
    assert first.prompt_ids == [1, 2]
    assert first.completion_ids == [3, 4, 9, 9, 5, 6, 10]
    assert first.loss_mask == [1, 1, 0, 0, 1, 0, 1]
    assert first.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5]
    assert first.versions == [0, 0, 1, 1, 1, 3, 3]
    assert first.calls == [0, 1, 3]
    assert (second.prompt_ids, second.completion_ids, second.calls) == ([7], [8], [2])


def test_a_call_that_rewrites_earlier_tokens_starts_a_new_sequence() -> None:
    sequences = assemble_sequences([call(0, [1, 2], [3]), call(1, [1, 2, 4], [5])])
    assert [s.calls for s in sequences] == [[0], [1]]


async def test_calculator_agent_on_the_episode_api_stores_the_servers_tokens() -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)
    result = await rollout(CalculatorEnv(), fake)
    assert len(result.completions) == 2  # one sequence per episode
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)
    for episode, completion in enumerate(result.completions):
        info = completion.info
        assert (info["episode"], info["sequence"], info["sequences"]) == (episode, 0, 1)
        assert info["capture"] == {"calls": 3, "token_in": 0, "text_drift": 0, "rejected": 0,
                                   "unavailable": 0, "resent": 0,
                                   "chat_fallback": 0}
        assert info["env_score"] == 1.0  # the last reply names the tool's last result (20)
        masked = decode([t for t, m in zip(completion.completion_ids.tolist(),
                                           completion.loss_mask.tolist(), strict=True) if not m])
        assert "tool\n42" in masked and "tool\n20" in masked  # tool results are env tokens
        assert completion.messages is not None and completion.messages[-1]["content"]
    assert fake.counts["/v1/completions"] == 0  # no drift: every call went as chat


async def test_tool_call_json_rerendered_differently_goes_token_in() -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)  # the template re-renders with spaces
    result = await rollout(CalculatorEnv(), fake, group_size=1)
    [completion] = result.completions
    assert completion.info["capture"]["text_drift"] == 2
    assert completion.info["capture"]["token_in"] == 2
    assert fake.counts["/v1/completions"] == 2  # calls 2 and 3 sent as token ids
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)
    assert completion.info["calls"] == [0, 1, 2]  # one sequence: nothing re-tokenised
    assert completion.info["env_score"] == 1.0  # token-in replies still carry tool calls


async def test_a_merged_token_the_tokenizer_never_makes_is_kept_by_token_in() -> None:
    fake = AgentFakeVLLM()
    fake.merge_ok = True
    fake.script = lambda prompt, number: "ok then" if number % 3 < 2 else "done"
    result = await rollout(RewritingEnv(), fake, group_size=1)
    assert fake.counts["/v1/completions"] > 0
    for completion in result.completions:
        assert PAIR in completion.completion_ids.tolist()
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)


async def test_a_context_rewriting_agent_makes_two_sequences_per_episode() -> None:
    fake = AgentFakeVLLM()
    result = await rollout(RewritingEnv(), fake, group_size=2)
    assert len(result.completions) == 4
    infos = [(c.info["episode"], c.info["sequence"], c.info["sequences"], c.info["calls"])
             for c in result.completions]
    assert infos == [(0, 0, 2, [0, 1]), (0, 1, 2, [2, 3]), (1, 0, 2, [0, 1]),
                     (1, 1, 2, [2, 3])]
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)
    # the group prompt is what every sequence shares; the rest of each prompt is masked
    for completion in result.completions:
        own = completion.info["prompt_tokens"]
        assert completion.loss_mask[:own].tolist() == [0] * own
        assert completion.info["env_score"] == 0.5
    second = result.completions[1]
    head = [*list(result.prompt_ids), *second.completion_ids[:second.info["prompt_tokens"]]]
    assert "Summary" in decode(head)


async def test_text_agent_on_completions_merges_and_counts_drift() -> None:
    fake = AgentFakeVLLM()
    fake.merge_ok = True
    fake.script = lambda prompt, number: " ok 5"
    result = await rollout(TextEnv(), fake, group_size=1)
    [completion] = result.completions
    assert completion.info["calls"] == [0, 1, 2]
    assert completion.info["capture"]["text_drift"] == 2
    prompts = [body["prompt"] for path, body in fake.requests if path == "/v1/completions"]
    assert isinstance(prompts[0], str) and all(isinstance(p, list) for p in prompts[1:])
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)


async def test_the_client_strips_forced_fields_unless_asked() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        capture = EpisodeCapture(Upstream(pool))
        client = EpisodeClient(capture)
        plain = await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        asked = await client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], logprobs=True,
            extra_body={"return_token_ids": True})
        text = await client.completions.create(prompt="hi", max_tokens=4)
        with pytest.raises(InferenceRequestError):
            await client.chat.completions.create(messages=[], n=2)
        captured = capture.close()
        with pytest.raises(ContractError):
            await client.completions.create(prompt="late")
    assert plain.choices[0].logprobs is None and "token_ids" not in plain.choices[0].model_extra
    assert asked.choices[0].logprobs is not None
    assert asked.choices[0].model_extra["token_ids"] == served(fake.replies[1])[0]
    assert text.choices[0].logprobs is None and text.choices[0].text
    sent = [body for path, body in fake.requests if path == "/v1/chat/completions"]
    assert all(b["logprobs"] and b["return_token_ids"] and b["model"] == "rollq-tiny"
               for b in sent)
    assert captured.stats.calls == 3 and captured.stats.rejected == 1  # n=2, refused
    # the shapes are OpenAI's own
    openai.types.chat.ChatCompletion.model_validate(plain.model_dump())
    openai.types.Completion.model_validate(text.model_dump())
    assert isinstance(plain, ChatCompletion) and isinstance(text, TextCompletion)


async def test_inference_failure_fails_the_episode_even_when_the_agent_swallows_it() -> None:
    class Swallowing(CalculatorEnv):
        async def run_episode(self, client: Any, item: Item, *, sampling: SamplingParams) -> float:
            try:
                await client.chat.completions.create(messages=[{"role": "user", "content": "x"}])
            except InferenceUnavailable:
                pass
            await client.chat.completions.create(messages=[{"role": "user", "content": "y"}])
            return 1.0

    fake = AgentFakeVLLM()
    fake.fail_next("503", 4)  # the pool's first try and its 3 retries
    async with pool_of(fake) as pool:
        pool.backoff = type(pool.backoff)(initial_s=0.0, max_s=0.0)
        with pytest.raises(InferenceUnavailable, match="episode 0"):
            await ClientEpisodeEnv(Swallowing()).rollout(
                Item(0, {}), pool, group_size=1, sampling=SAMPLING, policy_version=zero)


async def test_make_env_wraps_an_agent_env() -> None:
    env = make_env("tests.agents.agents:CalculatorEnv")
    assert isinstance(env, ClientEpisodeEnv) and env.name == "calculator" and len(env) == 3


async def test_policy_versions_are_read_per_call() -> None:
    versions = iter([3, 3, 4, 4, 4, 4])

    async def version() -> int:
        return next(versions)

    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)
    async with pool_of(fake) as pool:
        result = await ClientEpisodeEnv(CalculatorEnv()).rollout(
            Item(0, {"question": "What is 6*7?"}), pool, group_size=1, sampling=SAMPLING,
            policy_version=version)
    [completion] = result.completions
    assert completion.policy_version == 3
    assert completion.token_versions is not None
    assert set(np.unique(completion.token_versions).tolist()) == {3, 4}
