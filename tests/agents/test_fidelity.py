"""Request fidelity on the fake server: every field an agent sets reaches the server on every
call of its episode, token-in continuations included; a refused call the agent lets
through is a contract error, whichever way it reached the in-process gateway. (Agents that
ignore ``http_client``: ``test_gateway``, ``test_listener``; the real vLLM:
``test_fidelity_vllm``.)"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollq.producers.envs.episode import ClientEpisodeEnv, GatewayEpisodeEnv
from rollq.producers.inference import SamplingParams
from rollq.producers.inference.capture import EpisodeCapture, EpisodeClient, RemoteGateway, Upstream
from rollq.producers.inference.capture.session import chat_only_field
from rollq.schemas import decode_dead
from rollq.schemas.keys import stream_key
from tests.agents.agents import QUESTIONS, CalculatorEnv, CalculatorWorkflow, calculator_episode
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import (
    assert_exactly_served,
    pool_of,
    tool_script,
)
from tests.agents.pipeline import RUN, run_workers
from tests.agents.test_gateway import served_gateway
from tests.redis_server import RedisServer

SAMPLING = SamplingParams(temperature=1.0, max_tokens=64)
GENERATION = ("/v1/chat/completions", "/v1/completions")
FORCED = {"type": "function", "function": {"name": "calculator"}}
RECORDS = [{"question": question} for question in QUESTIONS]


async def zero() -> int:
    return 0


def generation_requests(fake: AgentFakeVLLM) -> list[tuple[str, dict[str, Any]]]:
    return [(path, body) for path, body in fake.requests if path in GENERATION]


async def test_every_field_the_agent_sets_reaches_token_in_continuations() -> None:
    """The agent's ``max_completion_tokens`` (above the worker's 64, which would cut the
    tool call), ``seed``, ``stop``, ``logit_bias`` and ``temperature`` on every call; the
    compact tool-call JSON drifts, so calls 2 and 3 go token-in to ``/v1/completions``."""
    fields = {"max_completion_tokens": 200, "seed": 7, "stop": ["\nUser:"],
              "logit_bias": {"5": -1.0}, "temperature": 0.5, "top_p": 0.9}
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    env = CalculatorEnv(options=lambda turn: dict(fields))
    async with pool_of(fake) as pool:
        result = await ClientEpisodeEnv(env).rollout(env.item(0), pool, group_size=1,
                                                     sampling=SAMPLING, policy_version=zero)
    sent = generation_requests(fake)
    assert [path for path, _ in sent] == ["/v1/chat/completions", "/v1/completions",
                                          "/v1/completions"]
    for path, body in sent:
        if path == "/v1/chat/completions":
            assert body["max_completion_tokens"] == 200 and "max_tokens" not in body
        else:
            assert body["max_tokens"] == 200  # the chat's budget, vLLM's precedence
        for key in ("seed", "stop", "logit_bias", "temperature", "top_p"):
            assert body[key] == fields[key], (path, key)
    [completion] = result.completions
    assert completion.finish_reason == "stop"  # no reply was cut at the worker's 64
    assert completion.info["env_score"] == 1.0
    assert completion.info["capture"]["token_in"] == 2
    assert_exactly_served(result.completions, list(result.prompt_ids), fake.replies)


@pytest.mark.parametrize("check", ["before", "after"])
@pytest.mark.parametrize("tool_choice", [FORCED, "required"])
async def test_a_forced_tool_choice_is_never_dropped_on_a_drifting_continuation(
        check: str, tool_choice: Any) -> None:
    """A named or ``required`` tool choice has no ``/v1/completions`` form: the drifting
    continuations go as chat with it (no render, no resend), kept as the server made them:
    each a sequence of its own, every trainable token the server's."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    async with pool_of(fake) as pool:
        capture = EpisodeCapture(Upstream(pool), defaults=SAMPLING.body(),
                                 continuation_check=check)  # type: ignore[arg-type]
        reward = await calculator_episode(
            EpisodeClient(capture), QUESTIONS[0],
            options=lambda turn: {"tool_choice": tool_choice, "max_completion_tokens": 200})
        captured = capture.close()
    sent = generation_requests(fake)
    assert [path for path, _ in sent] == ["/v1/chat/completions"] * 3
    assert all(body["tool_choice"] == tool_choice for _, body in sent)
    assert fake.counts.get("/tokenize", 0) == 0
    assert reward == 1.0
    stats = captured.stats
    assert (stats.calls, stats.chat_fallback, stats.text_drift, stats.token_in,
            stats.resent) == (3, 2, 2, 0, 0)
    assert [sequence.calls for sequence in captured.sequences] == [[0], [1], [2]]
    for sequence, reply in zip(captured.sequences, fake.replies, strict=True):
        assert sequence.completion_ids == reply["choices"][0]["token_ids"]  # nothing merged
        assert sequence.loss_mask == [1] * len(sequence.completion_ids)
        assert sequence.prompt_ids == reply["prompt_token_ids"]


async def test_an_auto_tool_choice_still_goes_token_in() -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    async with pool_of(fake) as pool:
        capture = EpisodeCapture(Upstream(pool), defaults=SAMPLING.body())
        await calculator_episode(EpisodeClient(capture), QUESTIONS[0],
                                 options=lambda turn: {"tool_choice": "auto",
                                                           "max_completion_tokens": 200})
        captured = capture.close()
    assert captured.stats.token_in == 2 and captured.stats.chat_fallback == 0
    assert [sequence.calls for sequence in captured.sequences] == [[0, 1, 2]]


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": [], "tools": [], "tool_choice": "auto", "max_completion_tokens": 3,
      "seed": 1, "stop": "x", "logit_bias": {}, "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}, "top_logprobs": 2, "logprobs": True,
      "chat_template_kwargs": {}, "parallel_tool_calls": True}, None),
    ({"tool_choice": "none"}, None),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": FORCED}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"echo": True}, "echo"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"some_future_field": 1}, "some_future_field"),
    ({"some_future_field": None}, None),
])
def test_fields_a_token_in_call_cannot_honour(body: dict[str, Any], field: str | None) -> None:
    assert chat_only_field(body) == field


@pytest.mark.parametrize("route", ["http_client", "loopback", "rollq gateway"])
@pytest.mark.parametrize("refusal", ["n=2", "context overflow"])
async def test_a_refused_call_the_agent_lets_through_is_a_contract_error_not_retried(
        redis_server: RedisServer, real_redis: aioredis.Redis, refusal: str,
        route: str) -> None:
    """The agent's own client raises ``openai.BadRequestError`` (not a rollq error): the
    job is dead-lettered ``contract_error`` on its first try, as the Failures table says,
    in-process (through ``http_client`` or the loopback listener) or through a ``rollq
    gateway`` process's HTTP (its close reports the refusal)."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)
    options: Any = None
    if refusal == "n=2":
        options = lambda turn: {"n": 2}  # noqa: E731
    else:
        fake.max_model_len = 20  # the first prompt is longer: vLLM answers 400
    workflow = CalculatorWorkflow(options=options, use_http_client=route == "http_client")
    async with contextlib.AsyncExitStack() as stack:
        gateway = None
        if route == "rollq gateway":
            gateway = RemoteGateway(await stack.enter_async_context(served_gateway(fake)))
        env = GatewayEpisodeEnv("calc-refused", workflow, RECORDS, gateway=gateway)
        groups = await run_workers(redis_server.url, real_redis, env, fake, [0])
    assert groups == []
    [(_, fields)] = await real_redis.xrange(stream_key(RUN, 0, "dead"))
    letter = decode_dead(fields)
    assert letter.reason == "contract_error"
    assert "refused model call" in letter.detail
    assert ("n=1" if refusal == "n=2" else "prompt too long") in letter.detail
    assert workflow.runs == 2  # one try (max_tries is 2): the group's two episodes
