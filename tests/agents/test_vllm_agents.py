"""The calculator agent (``openai`` client) against the real CPU vLLM: through the episode
API and, unchanged, through ``rollq gateway`` (real uvicorn), on real workers, to the
trainer SDK. Every trainable token is what vLLM returned, id for id and logprob for logprob.

Tool calling needs ``--enable-auto-tool-choice --tool-call-parser hermes`` and a chat
template that renders tools: the ``tool_vllm`` server (``tests/agents/conftest.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from rollq.ops.gateway.app import create_app
from rollq.ops.local.stack import VllmProcess
from rollq.ops.settings import GatewaySettings
from rollq.producers.envs.episode import ClientEpisodeEnv, GatewayEpisodeEnv
from rollq.producers.inference import InferencePool
from rollq.producers.inference.capture import RemoteGateway, Upstream
from rollq.producers.inference.capture.render import PROBE_MESSAGES, PROBE_TOOLS, LocalTemplate
from rollq.producers.inference.errors import InferenceRequestError
from rollq.schemas import TrajectoryGroup, decode_trajectory
from rollq.schemas.keys import stream_key
from tests.agents.agents import (
    QUESTIONS,
    CalculatorEnv,
    CalculatorWorkflow,
    RewritingEnv,
    calculator_episode,
)
from tests.agents.helpers import kept_replies, served, trainable_runs
from tests.agents.pipeline import run_workers, score_and_train
from tests.integration.recording import RecordingTransport
from tests.redis_server import RedisServer, free_port
from tests.serving import serve_asgi

# the first test starts the session's tool-calling vLLM (minutes on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
TEMPLATE = Path(__file__).with_name("tool_template.jinja")
GENERATION = ("/v1/chat/completions", "/v1/completions")


def check_exact(groups: list[TrajectoryGroup], recorder: RecordingTransport) -> None:
    replies = [reply for path, _, reply in recorder.exchanges if path in GENERATION]
    kept = [reply for reply in replies if any(reply in kept_replies(
        list(g.completions), list(g.prompt_ids), [reply]) for g in groups)]
    # the gateway checks continuations after sending: a drifted reply is discarded, resent
    resent = sum(c.info["capture"]["resent"] for g in groups for c in g.completions)
    assert len(replies) - len(kept) == resent
    runs = sorted(run for g in groups for c in g.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in kept)
    for group in groups:
        for completion in group.completions:
            assert 2 <= completion.info["capture"]["calls"] <= 4
            assert completion.info["sequences"] == 1  # the agent never rewrites its context
            assert 0 in completion.loss_mask.tolist()  # tool results and turn ends masked


@contextlib.asynccontextmanager
async def served_gateway(url: str, recorder: RecordingTransport,
                         **settings: Any) -> AsyncIterator[str]:
    port = free_port()
    app = create_app(GatewaySettings(inference=[url], port=port, **settings), transport=recorder)
    async with serve_asgi(app, port, start_timeout_s=30) as served_url:
        yield served_url


async def test_calculator_agent_on_real_vllm_episode_api_and_gateway(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    recorder = RecordingTransport()
    env = ClientEpisodeEnv(CalculatorEnv(max_tokens=24))
    groups = await run_workers(redis_server.url, real_redis, env, None, [0, 1],
                               inference_url=tool_vllm.url, transport=recorder)
    assert len(groups) == 2
    check_exact(groups, recorder)
    drift = sum(c.info["capture"]["text_drift"] for g in groups for c in g.completions)
    batch = await score_and_train(real_redis, groups)
    assert len(batch.groups) == 2

    await real_redis.flushall()
    through_gateway = RecordingTransport()
    async with served_gateway(tool_vllm.url, through_gateway) as url:
        workflow_env = GatewayEpisodeEnv(
            "calc-gateway", CalculatorWorkflow(max_tokens=24),
            [{"question": question} for question in QUESTIONS], gateway=RemoteGateway(url))
        groups = await run_workers(redis_server.url, real_redis, workflow_env, None, [0],
                                   inference_url=tool_vllm.url)
    check_exact(groups, through_gateway)
    batch = await score_and_train(real_redis, groups)
    assert len(batch.groups) == 1
    print(f"text-path drift over the episode-API run: {drift} calls")


async def test_a_context_rewriting_agent_on_real_vllm_makes_two_sequences_per_episode(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    recorder = RecordingTransport()
    groups = await run_workers(redis_server.url, real_redis, ClientEpisodeEnv(RewritingEnv()),
                               None, [0], inference_url=tool_vllm.url, transport=recorder)
    [group] = groups
    replies = [reply for path, _, reply in recorder.exchanges if path in GENERATION]
    assert len(replies) == 8  # 2 episodes x 4 calls
    runs = sorted(run for c in group.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in replies)  # id for id, logprob for logprob
    infos = [(c.info["episode"], c.info["sequence"], c.info["sequences"], c.info["calls"])
             for c in group.completions]
    assert infos == [(0, 0, 2, [0, 1]), (0, 1, 2, [2, 3]), (1, 0, 2, [0, 1]),
                     (1, 1, 2, [2, 3])]
    for completion in group.completions:
        own = completion.info["prompt_tokens"]
        assert completion.loss_mask[:own].tolist() == [0] * own  # its own prompt, masked
        assert 0 in completion.loss_mask[own:].tolist()  # the "next" turn between its calls
    batch = await score_and_train(real_redis, groups)
    assert [len(scored.trajectory.completions) for scored in batch.groups] == [4]


RENDERED: list[list[dict[str, Any]]] = [
    PROBE_MESSAGES,
    [{"role": "user", "content": "What is 6*7? Use the calculator."},
     {"role": "assistant", "content": "x y <tool_call> z", "tool_calls": []},
     {"role": "tool", "tool_call_id": "call-0", "content": "42"}],
    [{"role": "user", "content": "hi"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "calculator", "arguments": "{\"expression\": \"1+1\"}"}}]},
     {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "2"}]}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Äpfel: ☃ 🍎"},
     {"role": "assistant", "content": "  spaced\n\n", "reasoning": "hidden"}],
]


async def test_the_local_template_renders_as_vllm(tool_vllm: VllmProcess) -> None:
    """``LocalTemplate`` (the model's tokenizer, the server's template) gives the ids of
    vLLM's own ``/tokenize`` on tool conversations, every render shape; a template that is
    not the server's is caught by the probe."""
    template = LocalTemplate.load(str(tool_vllm.model_dir), str(TEMPLATE))
    assert template is not None
    async with InferencePool([tool_vllm.url], health_interval_s=None) as pool:
        server = Upstream(pool)
        checked = 0
        for messages in RENDERED:
            for tools in (PROBE_TOOLS, None):
                for generation, continued in ((True, False), (False, False), (False, True)):
                    options: dict[str, Any] = {
                        "tools": tools, "add_generation_prompt": generation,
                        "continue_final_message": continued}
                    try:
                        local: list[int] | str | None = template.render(messages, **options)
                    except Exception:  # the template refused it: so must the server
                        local = "refused"
                    try:
                        served: list[int] | str = await server.render(messages, **options)
                    except InferenceRequestError:
                        served = "refused"
                    assert local == served, (messages, options)
                    checked += served != "refused"
        assert checked >= 2 * 2 * len(RENDERED)
        # arguments as an object: vLLM refuses the request; locally, left to the server
        odd = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "1"}}}]}]
        assert template.render(odd) is None
        upstream = Upstream(pool, template=template, verify=4)
        for messages in RENDERED:
            await upstream.render(messages, tools=PROBE_TOOLS)
        assert await upstream.turn_end() == await server.turn_end()
        assert upstream.template is template and upstream.render_mismatches == 0
        assert upstream.local_renders == len(RENDERED) + 2

        wrong = LocalTemplate.load(str(tool_vllm.model_dir))  # the tokenizer's own template
        dropped = Upstream(pool, template=wrong)
        messages = RENDERED[1]
        assert await dropped.render(messages, tools=PROBE_TOOLS) == await server.render(
            messages, tools=PROBE_TOOLS)
        assert dropped.template is None and dropped.render_mismatches == 1


async def test_the_calculator_agent_through_a_gateway_rendering_locally(
        tool_vllm: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    """``rollq gateway --tokenizer --chat-template``: the same exact capture, with the
    continuations rendered in the gateway (no ``/tokenize`` after its checks)."""
    recorder = RecordingTransport()
    async with served_gateway(tool_vllm.url, recorder, tokenizer=str(tool_vllm.model_dir),
                              chat_template=str(TEMPLATE)) as url:
        workflow_env = GatewayEpisodeEnv(
            "calc-gateway", CalculatorWorkflow(max_tokens=24),
            [{"question": question} for question in QUESTIONS], gateway=RemoteGateway(url))
        groups = await run_workers(redis_server.url, real_redis, workflow_env, None, [0],
                                   inference_url=tool_vllm.url)
        async with httpx.AsyncClient() as http:
            renders = (await http.get(f"{url}/health")).json()["renders"]
    check_exact(groups, recorder)
    token_in = sum(c.info["capture"]["token_in"] for g in groups for c in g.completions)
    assert token_in > 0  # the random model's replies drift: continuations went token-in
    assert renders["mismatches"] == 0 and renders["local"] > 0
    tokenize = sum(path == "/tokenize" for path, _, _ in recorder.exchanges)
    assert tokenize == renders["server"] <= 4 + 16  # the probe and the checked renders
    batch = await score_and_train(real_redis, groups)
    assert len(batch.groups) == 1


async def test_the_calculator_agent_on_real_vllm_through_external_sessions(
        tool_vllm: VllmProcess, real_redis: aioredis.Redis) -> None:
    """An ``openai`` agent outside rollq's workers on ``rollq gateway --sessions`` (real
    uvicorn, real Redis): the same exact capture; its group reaches the traj stream when
    the last session closes; a call retried under its ``Idempotency-Key`` is generated once."""
    recorder = RecordingTransport()
    port = free_port()
    app = create_app(GatewaySettings(inference=[tool_vllm.url], port=port, run="ext-vllm",
                                     sessions=True), transport=recorder, redis=real_redis)
    async with serve_asgi(app, port, start_timeout_s=30) as url, \
            httpx.AsyncClient(base_url=url) as http:
        opened = (await http.post("/sessions", json={"env": "calc", "group_size": 2})).json()
        for session in opened["sessions"]:
            async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x",
                                          max_retries=0) as client:
                reward = await calculator_episode(client, QUESTIONS[0], max_tokens=24)
            closed = await http.post(f"/sessions/{session['session_id']}/close",
                                     json={"reward": reward})
            assert closed.status_code == 200, closed.text
        [single] = (await http.post("/sessions", json={"env": "calc"})).json()["sessions"]
        generations = len([p for p, _, _ in recorder.exchanges if p in GENERATION])
        body = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 8}
        answers = [(await http.post(f"{single['base_url']}/chat/completions", json=body,
                                    headers={"Idempotency-Key": "once"})).json()
                   for _ in range(2)]
        retried = len([p for p, _, _ in recorder.exchanges if p in GENERATION]) - generations
    [group] = [decode_trajectory(fields) for _, fields in
               await real_redis.xrange(stream_key("ext-vllm", 0, "traj"))]
    assert group.group_id == opened["group_id"] and len(group.completions) == 2
    replies = [reply for path, _, reply in recorder.exchanges if path in GENERATION]
    recorder.exchanges = [exchange for exchange in recorder.exchanges
                          if exchange[2] not in replies[generations:]]
    check_exact([group], recorder)
    assert answers[0] == answers[1] and retried == 1
