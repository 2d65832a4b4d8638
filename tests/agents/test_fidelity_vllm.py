"""The fidelity matrix on the real CPU vLLM: the same agents run straight to vLLM and through
rollq (a ``rollq gateway`` over uvicorn, the in-process gateway with and without the
agent using ``http_client``, the arealite client), and every request that reaches vLLM
through rollq carries the fields the agent's direct request carried, field by field.

Each turn of an agent sends its own ``seed`` (``100 + turn``), which is how an upstream
request is matched to the direct request of the same turn (a dropped seed fails the match).
A chat call rollq sends token-in (``/v1/completions``) is compared with the chat fields it
stands for: ``max_tokens`` for ``max_completion_tokens`` (vLLM's precedence), ``tools``
rendered into its prompt, ``tool_choice`` ``auto``/``none`` applied to its reply; any other
``tool_choice`` must never go token-in. What rollq adds is what it documents: token ids and
logprobs forced on (``TRANSPORT``), the served model's name, and, on token-in calls with
tools, ``skip_special_tokens: false`` (as vLLM's hermes parser sets it on a chat call).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from rollq.ops.local.stack import VllmProcess
from rollq.producers.envs.areal import ArealCollectorEnv, ArealGenerationConfig, areal_workflow_env
from rollq.producers.inference.capture import RemoteGateway
from rollq.schemas import decode_dead
from rollq.schemas.keys import stream_key
from tests.agents.agents import CALCULATOR, QUESTIONS, CalculatorWorkflow
from tests.agents.pipeline import RUN, run_workers
from tests.agents.test_areal import LLMRequest, SumAgent, SumCollector, SumEnvironment
from tests.agents.test_vllm_agents import served_gateway
from tests.integration.recording import RecordingTransport
from tests.redis_server import RedisServer

# the first test starts the session's tool-calling vLLM (minutes on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
GENERATION = ("/v1/chat/completions", "/v1/completions")
TRANSPORT = ("messages", "prompt", "model", "logprobs", "return_token_ids")
FORCED = {"type": "function", "function": {"name": CALCULATOR["function"]["name"]}}
RECORDS = [{"question": question} for question in QUESTIONS[:2]]


def tool_turn(turn: int) -> dict[str, Any]:
    """The tools agent's fields on turn ``turn``: every kind of ``tool_choice`` in turn."""
    return {"tool_choice": [FORCED, "required", "auto", "none"][turn % 4],
            "max_completion_tokens": 24 + 4 * turn, "seed": 100 + turn, "temperature": 0.8,
            "top_p": 0.95, "stop": ["\n\n\n"], "logit_bias": {"7": -0.5},
            "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "extra_body": {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.05}}


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}


def json_turn(turn: int) -> dict[str, Any]:
    """The AReaL-2 agent's fields: structured outputs on turns 0 and 1."""
    fields: dict[str, Any] = {"max_tokens": 16, "seed": 100 + turn, "temperature": 0.7,
                              "top_p": 0.9, "stop": ["}\n"], "logit_bias": {"9": 0.5}}
    if turn == 0:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "answer", "schema": SCHEMA}}
    elif turn == 1:
        fields["extra_body"] = {"structured_outputs": {"choice": ["yes", "no"]}}
    return fields


class JsonWorkflow:
    """An AReaL-2 workflow, ``async run(data, **kwargs)``: three chat turns with structured
    outputs, its own ``openai`` client (on ``http_client`` when given); AReaL's dict reward
    (one per completion id)."""

    async def run(self, data: dict[str, Any], **kwargs: Any) -> dict[str, float]:
        rewards: dict[str, float] = {}
        messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
        async with openai.AsyncOpenAI(base_url=kwargs["base_url"], api_key="none",
                                      http_client=kwargs.get("http_client"),
                                      max_retries=0) as client:
            for turn in range(3):
                reply = await client.chat.completions.create(
                    model="rollq-tiny", messages=messages, **json_turn(turn))
                content = reply.choices[0].message.content or ""
                rewards[f"{reply.id}-{turn}"] = float(content.startswith("{"))
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": "Once more."}]
        return rewards


def gconfig(turn: int) -> ArealGenerationConfig:
    return ArealGenerationConfig(max_new_tokens=8 + turn, min_new_tokens=2, temperature=0.6,
                                 top_p=0.9, top_k=30, stop_token_ids=[2], stop=["\n\n"])


def sent(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in TRANSPORT}


def as_direct(path: str, body: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """An upstream request through rollq in the terms of the agent's direct request."""
    fields = sent(body)
    if path == "/v1/completions" and "messages" in direct:  # a chat call sent token-in
        assert direct.get("tool_choice") in (None, "auto", "none"), direct
        if "max_completion_tokens" in direct:
            fields["max_completion_tokens"] = fields.pop("max_tokens")
        if direct.get("tools") and direct.get("tool_choice") != "none":
            assert fields.pop("skip_special_tokens") is False
        for key in ("tools", "tool_choice"):
            if key in direct:
                fields[key] = direct[key]
    return fields


def assert_same_semantics(direct: RecordingTransport, through: RecordingTransport) -> int:
    """Every generation request through rollq equals, field for field, the direct request
    of the same turn (matched by seed); returns how many were compared."""
    by_seed: dict[int, dict[str, Any]] = {}
    for path, body, _ in direct.exchanges:
        if path in GENERATION:
            assert sent(by_seed.setdefault(body["seed"], body)) == sent(body)  # fixed per turn
    assert len(by_seed) >= 3  # every turn of the agent was seen direct
    compared = token_in = 0
    for path, body, _ in through.exchanges:
        if path not in GENERATION:
            continue
        expected = by_seed[body["seed"]]
        assert as_direct(path, body, expected) == sent(expected), (path, body, expected)
        compared += 1
        token_in += path == "/v1/completions" and "messages" in expected
    assert compared >= 4
    return token_in


async def run_direct(workflow: Any, url: str) -> RecordingTransport:
    recorder = RecordingTransport()
    for record in RECORDS:
        async with httpx.AsyncClient(transport=recorder, timeout=120) as http:
            await workflow.run(dict(record), base_url=f"{url}/v1", http_client=http,
                               api_key="none")
    return recorder


@pytest.mark.parametrize("agent", ["openai-tools", "areal-2"])
async def test_agents_send_the_same_request_fields_through_rollq_as_direct(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
        agent: str) -> None:
    def workflow(use_http_client: bool = True) -> Any:
        if agent == "openai-tools":
            return CalculatorWorkflow(  # 4 calls an episode, whatever the model does
                scripted_tool_turns=4, options=tool_turn, use_http_client=use_http_client,
                model="rollq-tiny")  # direct: the served name
        return JsonWorkflow()

    direct = await run_direct(workflow(), tool_vllm.url)

    gateway_upstream = RecordingTransport()
    async with served_gateway(tool_vllm.url, gateway_upstream) as url:
        env = areal_workflow_env("fidelity-gw", workflow(), RECORDS, gateway=RemoteGateway(url))
        assert len(await run_workers(redis_server.url, real_redis, env, None, [0, 1],
                                     inference_url=tool_vllm.url)) == 2
    gateway_token_in = assert_same_semantics(direct, gateway_upstream)

    modes = [True, False] if agent == "openai-tools" else [True]
    for use_http_client in modes:  # False: the agent ignores http_client (loopback)
        await real_redis.flushall()
        upstream = RecordingTransport()
        env = areal_workflow_env(f"fidelity-local-{use_http_client}",
                                 workflow(use_http_client), RECORDS)
        assert len(await run_workers(redis_server.url, real_redis, env, None, [0, 1],
                                     inference_url=tool_vllm.url, transport=upstream)) == 2
        assert_same_semantics(direct, upstream)
    print(f"{agent}: token-in calls through the gateway: {gateway_token_in}")


class DirectArealClient:
    """AReaL's generation request to vLLM's ``/v1/completions``, written from AReaL's
    ``GenerationHyperparameters`` (no rollq code): what the collector sends without rollq."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http, self.url = http, url

    async def agenerate(self, req: LLMRequest) -> Any:
        g = req.gconfig
        body: dict[str, Any] = {
            "model": "rollq-tiny", "prompt": list(req.input_ids),
            "max_tokens": g.max_new_tokens, "min_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "stop_token_ids": g.stop_token_ids, "stop": g.stop,
            "logprobs": 0, "return_token_ids": True}
        response = await self.http.post(f"{self.url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        choice = reply["choices"][0]
        return type("Response", (), {"completion": choice["text"],
                                     "output_tokens": choice["token_ids"]})()


class SeededCollector(SumCollector):
    """``SumCollector`` whose agent asks with a ``gconfig`` per turn (AReaL's config has no
    seed: a request is matched to its turn by ``max_new_tokens``, 8 + turn)."""

    async def arun_episode(self, llm_client: Any, gconfig_: ArealGenerationConfig,
                           env_option: Any = None, seed: int | None = None) -> Any:
        turn = 0

        class Client:
            async def agenerate(self, req: LLMRequest) -> Any:
                nonlocal turn
                req.gconfig = gconfig(turn)
                turn += 1
                return await llm_client.agenerate(req)

        return await super().arun_episode(Client(), gconfig_, env_option, seed)


class EndlessSum(SumEnvironment):
    """Never solved: every episode makes ``max_turns`` calls, direct or through rollq."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "Wrong, try again.", 0.0, False, False, {}


def turn_of(body: dict[str, Any]) -> int:
    return int(body["max_tokens"]) - 8


async def test_an_arealite_collector_sends_the_same_request_fields_through_rollq(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    records = [{"terms": [2, 3]}, {"terms": [4, 4]}]
    direct = RecordingTransport()
    async with httpx.AsyncClient(transport=direct, timeout=120) as http:
        for index, record in enumerate(records):
            await SeededCollector(SumAgent, EndlessSum()).arun_episode(
                DirectArealClient(http, tool_vllm.url), ArealGenerationConfig(),
                env_option=record, seed=index)
    upstream = RecordingTransport()
    env = ArealCollectorEnv("fidelity-arealite",
                            lambda: SeededCollector(SumAgent, EndlessSum()), records)
    assert len(await run_workers(redis_server.url, real_redis, env, None, [0, 1],
                                 inference_url=tool_vllm.url, transport=upstream)) == 2
    by_turn = {turn_of(body): sent(body) for path, body, _ in direct.exchanges
               if path == "/v1/completions"}
    assert sorted(by_turn) == [0, 1, 2]
    compared = 0
    for path, body, _ in upstream.exchanges:
        if path == "/v1/completions":
            assert sent(body) == by_turn[turn_of(body)], (body, by_turn)
            compared += 1
    assert compared >= 4


async def test_a_context_overflow_on_real_vllm_is_a_contract_error_on_the_first_try(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    """vLLM's own 400 (the prompt exceeds the context), through the in-process gateway to
    an agent that lets ``openai.BadRequestError`` through: dead-lettered, not retried."""
    workflow = CalculatorWorkflow(model="rollq-tiny", use_http_client=False)
    env = areal_workflow_env("fidelity-overflow", workflow,
                             [{"question": "What is " + "1+" * 1200 + "1?"}])
    assert await run_workers(redis_server.url, real_redis, env, None, [0],
                             inference_url=tool_vllm.url) == []
    [(_, fields)] = await real_redis.xrange(stream_key(RUN, 0, "dead"))
    letter = decode_dead(fields)
    assert letter.reason == "contract_error" and "maximum context length" in letter.detail
    assert workflow.runs == 2  # the group's two episodes, one try
