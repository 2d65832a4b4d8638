"""The calculator agent (``openai`` client) against the real CPU vLLM: through the episode
API and, unchanged, through ``rollq gateway`` (real uvicorn), on real workers, to the
trainer SDK. Every trainable token is what vLLM returned, id for id and logprob for logprob.

Tool calling needs ``--enable-auto-tool-choice --tool-call-parser hermes`` and a chat
template that renders tools; the tiny model's template does not, so this module starts a
server of its own with ``tool_template.jinja`` (the session server keeps its flags).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import uvicorn

from ops.gateway.app import create_app
from ops.gateway.settings import GatewaySettings
from ops.stack import VllmProcess
from producers.envs.episode import ClientEpisodeEnv, GatewayEpisodeEnv
from producers.inference.capture import RemoteGateway
from schemas import TrajectoryGroup
from tests.agents.agents import QUESTIONS, CalculatorEnv, CalculatorWorkflow, RewritingEnv
from tests.agents.helpers import kept_replies, served, trainable_runs
from tests.agents.pipeline import run_workers, score_and_train
from tests.integration.recording import RecordingTransport
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TEMPLATE = Path(__file__).with_name("tool_template.jinja")
GENERATION = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def tool_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    python = os.environ.get("ROLLQ_TEST_VLLM_PYTHON", "")
    if not python:
        if os.environ.get("ROLLQ_REQUIRE_VLLM") == "1":
            pytest.fail("ROLLQ_REQUIRE_VLLM=1 but ROLLQ_TEST_VLLM_PYTHON is not set")
        pytest.skip("no vLLM: set ROLLQ_TEST_VLLM_PYTHON (bash .ci/test does)")
    from ops.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tool-vllm")
    model = write_tiny_model(directory / "rollq-tiny", seed=0)
    # VllmProcess runs `python -m vllm...api_server <flags>`: a wrapper adds the tool flags
    wrapper = directory / "python-with-tools"
    wrapper.write_text(f'#!/bin/sh\nexec "{Path(python).absolute()}" "$@" '
                       f'--enable-auto-tool-choice --tool-call-parser hermes '
                       f'--chat-template "{TEMPLATE}"\n')
    wrapper.chmod(0o755)
    cache = Path(python).absolute().parent.parent / "inductor-cache"
    server = VllmProcess(str(wrapper), model, directory / "server.log", max_model_len=1024,
                         compile_cache=cache).start()
    yield server
    server.stop()


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
async def served_gateway(url: str, recorder: RecordingTransport) -> AsyncIterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(GatewaySettings(inference=[url], port=port), transport=recorder)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:  # noqa: ASYNC110  uvicorn sets a flag, no event
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


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
