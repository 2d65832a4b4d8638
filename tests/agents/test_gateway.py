"""The capturing gateway: an unmodified ``openai`` agent per episode base URL, in-process
(ASGI, the capture transport) and through a real uvicorn; streaming; errors; real workers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis.asyncio as aioredis

from rollq.ops.cli import build_parser
from rollq.ops.gateway.app import create_app
from rollq.ops.settings import GatewaySettings
from rollq.producers.envs.base import EpisodeResult, Item
from rollq.producers.envs.episode import ClientEpisodeEnv, GatewayEpisodeEnv, build_rollout
from rollq.producers.inference.capture import CapturedEpisode, RemoteGateway
from rollq.schemas import InferenceUnavailable
from rollq.schemas.failures import Kind, classify
from tests.agents.agents import (
    CALCULATOR,
    QUESTIONS,
    CalculatorEnv,
    CalculatorWorkflow,
    calculator_episode,
)
from tests.agents.fake_agent_vllm import AgentFakeVLLM, decode
from tests.agents.helpers import (
    assert_exactly_served,
    kept_replies,
    served,
    tool_script,
    trainable_runs,
)
from tests.agents.pipeline import run_workers, score_and_train
from tests.producers.fake_vllm import fake_transport
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer, free_port
from tests.serving import serve_asgi

RECORDS = [{"question": question, "answer": "42"} for question in QUESTIONS]


@contextlib.asynccontextmanager
async def gateway(fake: AgentFakeVLLM, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny", **settings),
                     transport=fake_transport(fake))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://gw.test") as client:
        client.agent_transport = transport  # type: ignore[attr-defined]
        yield client


def agent_on(http: httpx.AsyncClient, base_url: str, **options: Any) -> openai.AsyncOpenAI:
    """An unmodified ``openai`` client on the in-process gateway (its own http client)."""
    transport = http.agent_transport  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=base_url, api_key="x",
                              http_client=httpx.AsyncClient(transport=transport), **options)


async def open_episode(client: httpx.AsyncClient) -> str:
    response = await client.post("/episodes")
    assert response.status_code == 200
    return str(response.json()["episode_id"])


async def test_an_unmodified_openai_agent_is_captured_per_episode() -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    async with gateway(fake, continuation_check="after") as http:
        ids = [await open_episode(http) for _ in range(2)]
        rewards = []
        for episode_id in ids:
            async with agent_on(http, f"http://gw.test/episodes/{episode_id}/v1") as agent:
                rewards.append(await calculator_episode(agent, QUESTIONS[0]))
                models = await agent.models.list()
        closed = [CapturedEpisode.model_validate((await http.post(
            f"/episodes/{episode_id}/close")).json()) for episode_id in ids]
        again = await http.post(f"/episodes/{ids[0]}/close")
    assert rewards == [1.0, 1.0] and models.data[0].id == "rollq-tiny"
    assert again.status_code == 404
    for episode in closed:
        [sequence] = episode.sequences
        assert episode.stats.calls == 3 and episode.stats.text_drift == 2
        # checked after: call 1's reformatted tool call makes call 2 drift, so its reply is
        # discarded and resent token-in; call 3 is checked before sending
        assert episode.stats.resent == 1 and episode.stats.token_in == 2
        assert sequence.calls == [0, 1, 2]
        masked = decode([t for t, m in zip(sequence.completion_ids, sequence.loss_mask,
                                           strict=True) if not m])
        assert "tool\n42" in masked and "tool\n20" in masked
    rollout = build_rollout([(c, EpisodeResult()) for c in closed], Item(0, {}))
    kept = kept_replies(rollout.completions, list(rollout.prompt_ids), fake.replies)
    assert len(fake.replies) - len(kept) == 2  # the two discarded generations
    assert_exactly_served(rollout.completions, list(rollout.prompt_ids), kept)


@pytest.mark.parametrize(("check", "tokenize_calls"), [("after", 0), ("before", 6)])
async def test_continuations_checked_after_cost_no_request_when_nothing_drifts(
        check: str, tokenize_calls: int) -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)  # the template re-renders these replies as is
    async with gateway(fake, continuation_check=check) as http:
        episode_id = await open_episode(http)
        async with agent_on(http, f"http://gw.test/episodes/{episode_id}/v1") as agent:
            assert await calculator_episode(agent, QUESTIONS[0]) == 1.0
        closed = CapturedEpisode.model_validate(
            (await http.post(f"/episodes/{episode_id}/close")).json())
    assert closed.stats.calls == 3 and closed.stats.text_drift == closed.stats.resent == 0
    # before: two renders per continuation, and the turn-end probe (two, once per gateway)
    assert fake.counts["/tokenize"] == tokenize_calls
    assert fake.counts["/v1/chat/completions"] == 3 and len(closed.sequences) == 1
    rollout = build_rollout([(closed, EpisodeResult())], Item(0, {}))
    assert_exactly_served(rollout.completions, list(rollout.prompt_ids), fake.replies)


async def test_replies_lose_forced_fields_unless_asked_and_streaming_works() -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)
    async with gateway(fake) as http:
        episode_id = await open_episode(http)
        base = f"http://gw.test/episodes/{episode_id}/v1"
        async with agent_on(http, base) as agent:
            messages: list[Any] = [{"role": "user", "content": "What is 6*7?"}]
            plain = await agent.chat.completions.create(model="m", messages=messages, max_tokens=96,
                                                        tools=[CALCULATOR])
            asked = await agent.chat.completions.create(model="m", messages=messages, max_tokens=96,
                                                        logprobs=True)
            stream = await agent.chat.completions.create(
                model="m", messages=messages, tools=[CALCULATOR], stream=True, max_tokens=96,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = await agent.completions.create(model="m", prompt="2+2=", max_tokens=4,
                                                  stream=True)
            text_chunks = [chunk async for chunk in text]
        captured = CapturedEpisode.model_validate(
            (await http.post(f"/episodes/{episode_id}/close")).json())
    choice = plain.choices[0]
    assert choice.logprobs is None and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "calculator"
    assert "token_ids" not in (choice.model_extra or {})
    assert asked.choices[0].logprobs is not None
    calls = [c for chunk in chunks for choice in chunk.choices
             for c in choice.delta.tool_calls or []]
    assert calls and calls[0].function and calls[0].function.name == "calculator"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(c.choices[0].text for c in text_chunks if c.choices) == \
        fake.replies[-1]["choices"][0]["text"]
    assert captured.stats.calls == 4
    # the same first question three times: three sequences of one call each, and the text call
    assert len(captured.sequences) == 4


async def test_gateway_errors_answer_in_openais_shape() -> None:
    fake = AgentFakeVLLM()
    async with gateway(fake) as http:
        async with agent_on(http, "http://gw.test/episodes/nope/v1", max_retries=0) as agent:
            with pytest.raises(openai.NotFoundError):
                await agent.chat.completions.create(model="m", messages=[])
        episode_id = await open_episode(http)
        base = f"http://gw.test/episodes/{episode_id}/v1"
        async with agent_on(http, base, max_retries=0) as agent:
            fake.down = True
            with pytest.raises(openai.InternalServerError) as down:
                await agent.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": "hi"}])
            assert down.value.status_code == 503
            fake.down = False
            with pytest.raises(openai.BadRequestError):
                await agent.chat.completions.create(model="m", n=2, messages=[
                    {"role": "user", "content": "hi"}])
        assert (await http.post(base + "/chat/completions", content=b"{")).status_code == 400
        closed = CapturedEpisode.model_validate(
            (await http.post(f"/episodes/{episode_id}/close")).json())
        assert closed.stats.unavailable == 1 and closed.unavailable_error
        assert (await http.get("/health")).json()["episodes"] == 0


async def test_idle_episodes_expire() -> None:
    fake = AgentFakeVLLM()
    app = create_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny",
                                     episode_ttl_s=5), transport=fake_transport(fake))
    async with app.router.lifespan_context(app):
        hub = app.state.hub
        capture = hub.open()
        assert hub.expire(now=capture.last_used + 1) == []
        assert hub.expire(now=capture.last_used + 6) == [capture.episode_id]
        assert hub.expired == 1 and not hub.episodes


def test_rollq_gateway_is_a_command() -> None:
    args = build_parser().parse_args(["gateway", "--port", "0", "--inference", "http://a:1"])
    assert args.inference == ["http://a:1"] and args.port == 0


async def test_rollq_gateway_process_captures_an_unmodified_agent() -> None:
    """``rollq gateway`` as users start it: a process in front of a vLLM on a real port; an
    unmodified ``openai`` agent is captured per episode; SIGTERM ends it with exit 0."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    port = free_port()
    async with serve_fake(fake) as upstream:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollq", "gateway", "--port", str(port),
            "--inference", upstream, "--model", "rollq-tiny", "--log-format", "json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                await _until_up(http, process)
                episode_id = await open_episode(http)
                async with openai.AsyncOpenAI(
                        base_url=f"http://127.0.0.1:{port}/episodes/{episode_id}/v1",
                        api_key="x", max_retries=0) as agent:
                    reward = await calculator_episode(agent, QUESTIONS[0])
                closed = CapturedEpisode.model_validate(
                    (await http.post(f"/episodes/{episode_id}/close")).json())
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 30)
    assert reward == 1.0 and closed.stats.calls == 3 and len(closed.sequences) == 1
    rollout = build_rollout([(closed, EpisodeResult())], Item(0, {}))
    kept = kept_replies(rollout.completions, list(rollout.prompt_ids), fake.replies)
    assert len(kept) == len(fake.replies) == 3  # checked before sending: none discarded
    assert_exactly_served(rollout.completions, list(rollout.prompt_ids), kept)
    assert process.returncode == 0, output.decode()[-2000:]


async def _until_up(http: httpx.AsyncClient, process: asyncio.subprocess.Process,
                    timeout_s: float = 60.0) -> None:
    """Wait until the gateway answers ``/health``; fails at once if the process died."""
    async with asyncio.timeout(timeout_s):
        while process.returncode is None:
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    output = await process.stdout.read() if process.stdout else b""
    raise AssertionError(f"rollq gateway exited {process.returncode}: {output.decode()[-2000:]}")


async def test_an_episode_lost_by_a_restarted_gateway_is_retried_not_dead_lettered() -> None:
    """A ``rollq gateway`` restarted mid-episode (kill -9, a new deploy) has forgotten the
    episode: closing it is a failure a new try recovers from, not a bad request."""
    fake = AgentFakeVLLM()
    port = free_port()
    async with served_gateway(fake, port) as url:
        gateway = RemoteGateway(url)
        episode = await gateway.open(defaults={}, policy_version=None)
    async with served_gateway(fake, port):  # the same address, a fresh process's memory
        with pytest.raises(InferenceUnavailable, match="no longer has the episode") as caught:
            await gateway.close(episode)
    assert classify(caught.value).kind is Kind.TRANSIENT


@pytest.mark.parametrize("use_http_client", [True, False])
async def test_workflow_through_the_in_process_gateway_on_real_workers(
        redis_server: RedisServer, real_redis: aioredis.Redis, use_http_client: bool) -> None:
    """``use_http_client=False``: the agent builds its own client from the base URL alone,
    served by the worker's loopback listener while the group's episodes are open."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    env = GatewayEpisodeEnv("calc-gw", CalculatorWorkflow(use_http_client=use_http_client),
                            RECORDS)
    groups = await run_workers(redis_server.url, real_redis, env, fake, [0, 1])
    assert sorted(len(g.completions) for g in groups) == [2, 2]
    for group in groups:
        assert [c.info["capture"]["calls"] for c in group.completions] == [3, 3]
        assert all(c.info["env_score"] == 1.0 for c in group.completions)
    all_runs = sorted(run for g in groups for c in g.completions for run in trainable_runs(c))
    assert all_runs == sorted(served(r) for r in fake.replies)
    [local] = env._local.values()
    assert local._listening is None and local._open == 0  # no port held between groups
    batch = await score_and_train(real_redis, groups)
    for group in batch.groups:
        assert [s.reward for s in group.scores] == [1.0, 1.0]
    row = batch.input_ids[0][: batch.lengths[0]].tolist()
    first = batch.groups[0].trajectory
    assert row == [*first.prompt_ids.tolist(), *first.completions[0].completion_ids.tolist()]


async def test_episode_api_agent_on_real_workers_reaches_the_trainer(
        redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=False)
    groups = await run_workers(redis_server.url, real_redis, ClientEpisodeEnv(CalculatorEnv()),
                               fake, [0, 1, 2])
    assert len(groups) == 3
    batch = await score_and_train(real_redis, groups)
    assert len(batch.groups) == 3
    for scored in batch.groups:
        for completion in scored.trajectory.completions:
            assert np.all(completion.logprobs[completion.loss_mask == 0] == 0)


@contextlib.asynccontextmanager
async def served_gateway(fake: AgentFakeVLLM, port: int | None = None) -> AsyncIterator[str]:
    port = port or free_port()
    app = create_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny",
                                     port=port), transport=fake_transport(fake))
    async with serve_asgi(app, port) as url:
        yield url


async def test_remote_gateway_over_real_uvicorn_with_an_agent_that_builds_its_own_client(
        redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    async with served_gateway(fake) as url:
        env = GatewayEpisodeEnv("calc-remote", CalculatorWorkflow(), RECORDS,
                                gateway=RemoteGateway(url))
        # the worker's own pool is unused by a remote gateway; it still needs a server URL
        groups = await run_workers(redis_server.url, real_redis, env, fake, [0])
    [group] = groups
    assert len(group.completions) == 2
    assert all(c.info["capture"]["calls"] == 3 for c in group.completions)
    assert all(c.info["capture"]["resent"] == 0 for c in group.completions)  # checked before
    runs = sorted(run for c in group.completions for run in trainable_runs(c))
    assert runs == sorted(served(r) for r in fake.replies)
