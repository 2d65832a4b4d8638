"""The ``openenv:`` env kind against real OpenEnv servers (openenv 0.10.0, unchanged).

The env is the guessing game written as OpenEnv's docs write one
(``tests/openenv_envs/guess_env``: ``create_app`` over an ``Environment`` subclass, one
session at a time as the template's ``max_concurrent_envs=1``). Two servers are shared by
the module (rollq's launcher, as a worker starts one; started together: each costs some
5 s of imports): ``plain`` and ``fast_ping`` (WebSocket pings every second and a 1.5 s
session timeout). Each test starts from no open session.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.producers.envs import make_env, openenv_session
from rollq.producers.envs.base import Rollout
from rollq.producers.envs.openenv import OpenEnvEnv
from rollq.producers.envs.openenv_session import EnvSession
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.worker import build_worker, close_worker
from rollq.schemas import ConfigError, decode_dead, decode_trajectory
from rollq.schemas.failures import ENV_REWARD_MISSING, ENV_UNAVAILABLE, classify
from rollq.schemas.keys import stream_key
from tests.openenv_envs.servers import (
    GUESS_APP,
    REPO,
    EnvServer,
    capacity,
    ready,
    session_events,
    start,
)
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.producers.fake_vllm_server import serve_fake
from tests.producers.jobs import enqueue_positions
from tests.redis_server import RedisServer
from tests.waiting import until

pytest.importorskip("openenv", reason="the openenv extra is not installed")
from tests.openenv_envs.guess_env.models import GuessAction
from tests.openenv_envs.guess_env.server.guess_environment import GuessEnvironment

pytestmark = pytest.mark.timeout(300)  # the module's two servers start in its first test:
# openenv imports gradio, some 5 s alone and a minute on a loaded machine
RUN = "openenv"
_TURN = re.compile(r"assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\nWrong: my number is "
                   r"(higher|lower)")


def bisector(prompt: str, index: int) -> str:
    """A scripted player: halves the range the hints leave (3 tries: not always enough)."""
    low, high = 1, 10
    for guess, hint in _TURN.findall(prompt):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def replayed(seed: int, replies: list[str]) -> list[float]:
    """The game's own rewards for ``replies``, from an env made here (logged as a session
    when ``GUESS_ENV_LOG`` is set: read the log before)."""
    env = GuessEnvironment()
    env.reset(seed=seed)
    rewards = []
    for reply in replies:
        observation = env.step(GuessAction(guess=reply))
        rewards.append(float(observation.reward or 0.0))
        if observation.done:
            break
    return rewards


def assert_played(rollout: Rollout, seed: int) -> None:
    """Every episode the game's own, its tokens exact: model turns trainable with the
    server's logprobs, the game's messages between them masked."""
    for completion in rollout.completions:
        replies = [m["content"] for m in completion.messages or [] if m["role"] == "assistant"]
        assert completion.turn_rewards == replayed(seed, replies)
        assert completion.info["stop"] == "terminated"
        mask, logprobs = np.asarray(completion.loss_mask), np.asarray(completion.logprobs)
        assert mask[0] == 1 and mask[-1] == 1 and (0 in mask) == (len(replies) > 1)
        assert np.all(logprobs[mask == 0] == 0) and np.all(logprobs[mask == 1] < 0)


async def version() -> int:
    return 0


async def dead_letters(redis: aioredis.Redis) -> dict[str, tuple[str, str]]:
    letters = [decode_dead(f) for _, f in await redis.xrange(stream_key(RUN, 0, "dead"))]
    return {letter.source_id: (letter.reason, letter.detail) for letter in letters}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EnvServer]]:
    root = tmp_path_factory.mktemp("openenv")
    launched = {"plain": start(root / "plain", "--session-timeout", "2",
                               "--max-concurrent-envs", "2"),
                "fast_ping": start(root / "fast_ping", "--session-timeout", "1.5",
                                   "--ws-ping", "1", "--max-concurrent-envs", "2")}
    found = {name: ready(process, root / name) for name, process in launched.items()}
    yield found
    for server in found.values():
        server.stop()


@pytest.fixture
async def plain(servers: dict[str, EnvServer]) -> AsyncIterator[EnvServer]:
    server = servers["plain"]
    await until(lambda: server.capacity()["active_sessions"] == 0, "no open session")
    yield server


@pytest.fixture
async def pool() -> AsyncIterator[tuple[InferencePool, FakeVLLM]]:
    fake = FakeVLLM(max_model_len=4096)
    fake.responder = bisector
    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as client:
        yield client, fake


async def rollout(env: Any, pool: InferencePool, seed_index: int = 0,
                  group_size: int = 2) -> Rollout:
    result: Rollout = await env.rollout(env.item(seed_index), pool, group_size=group_size,
                                        sampling=SamplingParams(max_tokens=32),
                                        policy_version=version)
    return result


@pytest.mark.slow  # 16 sessions one after another and two server starts
async def test_a_group_of_8_on_a_one_session_server_runs_one_after_another(
        pool: tuple[InferencePool, FakeVLLM], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The acceptance case, on a server the worker starts itself (``openenv:MODULE:APP``):
    the app allows one session; a group of 8 runs its 8 sessions one after another, says
    so once, and leaves none open. Its env crashing the server mid-episode is
    ``env_unavailable``; the next group gets a new server."""
    client, fake = pool
    monkeypatch.setenv("GUESS_ENV_LOG", str(tmp_path / "sessions.log"))
    env = make_env(f"openenv:{GUESS_APP}", size=3, first_seed=20, session_timeout_s=30)
    assert isinstance(env, OpenEnvEnv) and env.server is not None
    try:
        with capture_logs() as logs:
            first = await rollout(env, client, 1, group_size=8)
            second = await rollout(env, client, 2, group_size=8)
        events = [event for event, _ in session_events(tmp_path / "sessions.log")]
        assert events == ["open", "close"] * 16  # never two at once
        assert len(first.completions) == len(second.completions) == 8
        assert_played(first, 21)
        assert_played(second, 22)
        warned = [e for e in logs if e["event"] == "openenv_sessions_limited"]
        assert len(warned) == 1 and warned[0]["max_concurrent_envs"] == 1  # once
        assert "max_concurrent_envs" in warned[0]["detail"]
        assert fake.max_in_flight == 1
        assert env.server.url is not None
        assert capacity(env.server.url) == {"active_sessions": 0, "max_sessions": 1,
                                            "session_timeout_s": 30.0}
        fake.responder = lambda prompt, index: "crash"  # the env kills its server mid-episode
        with pytest.raises(BaseException) as crashed:
            await rollout(env, client, 0)
        failure = classify(crashed.value)
        assert failure.reason == ENV_UNAVAILABLE and "WebSocket" in failure.detail
        process = env.server._process
        assert process is not None  # its exit is noticed, as by a job's retry a back-off later
        await until(lambda: process.returncode is not None, "the crashed server's exit")
        fake.responder = bisector
        with capture_logs() as logs:
            assert_played(await rollout(env, client, 0), 20)  # a new server
        assert [e["event"] for e in logs if "restarted" in e["event"]] == [
            "openenv_server_restarted"]
        process = env.server._process
    finally:
        await env.aclose()
    assert process is not None and process.returncode is not None  # stopped with the env


@pytest.mark.slow  # real workers, retried jobs
async def test_an_episode_without_a_reward_and_a_server_down_are_dead_lettered(
        plain: EnvServer, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    """Through real workers on a real redis-server: a step that ends the episode with no
    reward and a server that is down are retried, then dead-lettered with their reasons;
    no group is published (no reward of 0)."""
    fake = FakeVLLM(max_model_len=4096)
    fake.responder = lambda prompt, index: "no reward"
    unreachable = f"http://127.0.0.1:{_closed_port()}"
    for env in (make_env(f"openenv:{plain.url}", size=2),
                make_env(f"openenv:{unreachable}", size=2, connect_timeout_s=2)):
        await Publisher(real_redis, RUN).register()
        await enqueue_positions(redis_server.url, RUN, env.name, [0])
        worker = build_worker(
            redis_url=redis_server.url, run=RUN, env_factory=lambda env=env: env,
            inference_urls=[fake.base_url], model=None, sampling=SamplingParams(max_tokens=16),
            group_size=2, concurrency=1, job_timeout_s=20, max_tries=2, request_timeout_s=5,
            burst=True, retry_base_s=0.01, transport=fake_transport(fake))
        try:
            await asyncio.wait_for(worker.main(), 60)
        finally:
            await close_worker(worker)
    letters = await dead_letters(real_redis)
    assert {reason for reason, _ in letters.values()} == {ENV_REWARD_MISSING, ENV_UNAVAILABLE}
    for reason, detail in letters.values():
        assert detail.startswith("after 2 tries")
        assert ("with no reward" if reason == ENV_REWARD_MISSING else "unreachable") in detail
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 0
    await until(lambda: plain.capacity()["active_sessions"] == 0, "the sessions closed")


async def test_a_running_servers_limit_is_learned_from_its_refusal(
        plain: EnvServer, pool: tuple[InferencePool, FakeVLLM]) -> None:
    """A server by URL (two sessions at most) and a group of 4: the refused sessions learn
    the limit from OpenEnv's CAPACITY_REACHED, wait for free slots, and the worker says so
    once; the group completes with the game's own rewards."""
    client, fake = pool
    env = make_env(f"openenv:{plain.url}")
    assert isinstance(env, OpenEnvEnv) and env.slots.limit is None
    with capture_logs() as logs:
        played = await rollout(env, client, 3, group_size=4)
    assert env.slots.limit == 2 and fake.max_in_flight <= 2
    warned = [e for e in logs if e["event"] == "openenv_sessions_limited"]
    assert len(warned) == 1 and warned[0]["max_concurrent_envs"] == 2
    assert "create_app" in warned[0]["detail"]  # where a running server's limit is raised
    assert len(played.completions) == 4
    assert_played(played, 3)
    await until(lambda: plain.capacity()["active_sessions"] == 0, "the sessions closed")


async def test_cancelled_episodes_close_their_sessions(plain: EnvServer) -> None:
    """A job cancelled mid-episode (its timeout, or SIGTERM past the grace period: the
    worker cancels the job either way) closes its sessions on the way out."""
    fake = FakeVLLM(max_model_len=4096, latency_s=60.0)
    env = make_env(f"openenv:{plain.url}")
    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as client:
        job = asyncio.create_task(rollout(env, client, group_size=2))
        await until(lambda: plain.capacity()["active_sessions"] == 2, "both episodes open")
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
    assert plain.capacity()["active_sessions"] == 0  # closed before the cancel returned
    assert env.slots.held == 0  # type: ignore[attr-defined]


async def test_a_session_whose_server_never_answers_its_close_is_closed_all_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepted the WebSocket and then fell silent (its loop blocked) never
    completes the closing handshake: the session still closes its TCP connection, which
    the server sees as an end of stream. Left open, the socket would be the garbage
    collector's, a ResourceWarning in whichever later test it collects in."""
    monkeypatch.setattr(openenv_session, "CLOSE_WAIT_S", 0.1)
    peers: list[asyncio.StreamReader] = []
    writers: list[asyncio.StreamWriter] = []

    async def accept_then_fall_silent(reader: asyncio.StreamReader,
                                      writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"sec-websocket-key: *(\S+)", head, re.IGNORECASE)
        assert found is not None
        digest = hashlib.sha1(found.group(1) + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
                     + base64.b64encode(digest.digest()) + b"\r\n\r\n")
        peers.append(reader)
        writers.append(writer)

    server = await asyncio.start_server(accept_then_fall_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        session = await EnvSession.open(f"http://127.0.0.1:{port}", keepalive_s=None)
        await session.close()
        [peer] = peers
        await asyncio.wait_for(peer.read(), timeout=10)  # to the end of the stream
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_reply_that_is_no_action_ends_the_episode_with_its_reward(
        plain: EnvServer, pool: tuple[InferencePool, FakeVLLM]) -> None:
    client, fake = pool
    env = make_env(f"openenv:{plain.url}", action="json", invalid_action_reward=-2.0)
    fake.responder = lambda prompt, index: 'I guess {"guess": "5"}' if index == 0 else "five"
    played = await rollout(env, client)
    for completion in played.completions:
        reply = completion.messages[0]["content"]  # type: ignore[index]
        if "{" in reply:  # parsed: the game's own reward
            assert completion.turn_rewards[0] == replayed(0, ["5"])[0]
        else:
            assert completion.turn_rewards == [-2.0]
            assert "no JSON object" in completion.info["env_info"]["invalid_action"]
    fake.responder = lambda prompt, index: '{"number": 5}'  # the env's model refuses it
    refused = await rollout(env, client)
    assert all(c.turn_rewards == [-2.0] for c in refused.completions)
    assert "guess" in refused.completions[0].info["env_info"]["invalid_action"]
    await until(lambda: plain.capacity()["active_sessions"] == 0, "the sessions closed")


GENERATION_S = 9.0
"""The slow fake's generation: longer than the 1.5 s session timeout plus one 5 s round of
OpenEnv's reaper, with 2.5 s to spare for a loaded machine."""


async def test_long_generations_keep_their_sessions(servers: dict[str, EnvServer]) -> None:
    """A 9 s generation (slow fake inference) on a server that pings every second and
    reaps sessions idle 1.5 s: the episode that keeps its session alive keeps it (the one
    with the keep-alive off loses it to OpenEnv's reaper, mid-episode), and the WebSocket
    outlives the pings; a generation that blocks the event loop (what OpenEnv #362's
    clients did) loses its WebSocket: ``env_unavailable``, not a reward."""
    server = servers["fast_ping"]
    await until(lambda: server.capacity()["active_sessions"] == 0, "no open session")
    fake = FakeVLLM(max_model_len=4096, latency_s=GENERATION_S)
    fake.responder = lambda prompt, index: str(random.Random(0).randint(1, 10))
    kept = make_env(f"openenv:{server.url}", keepalive_s=0.3)
    unkept = make_env(f"openenv:{server.url}", keepalive_s=None)
    seen: list[tuple[float, int]] = []

    async def watch() -> None:
        while True:
            active = (await asyncio.to_thread(server.capacity))["active_sessions"]
            seen.append((time.monotonic(), active))
            await asyncio.sleep(0.2)

    finished: list[float] = []

    async def played(env: Any) -> Rollout:
        result = await rollout(env, client, group_size=1)
        finished.append(time.monotonic())
        return result

    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as client:
        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(played(kept), played(unkept))
        watcher.cancel()
        assert [r.completions[0].turn_rewards for r in results] == [[1.0], [1.0]]
        # while both generate: both sessions open, then the reaper's round (every 5 s)
        # takes the unkept one; the kept one stays, so the count never reaches 0
        both = next(at for at, active in seen if active == 2)
        during = [active for at, active in seen if both <= at < min(finished) - 0.3]
        assert during[-1] == 1 and 0 not in during, during
        fake.latency_s = 0.0

        def blocking(prompt: str, index: int) -> str:
            time.sleep(3.5)  # a generation that holds the event loop: no pong goes out
            return "1"

        fake.responder = blocking
        with pytest.raises(BaseException) as dropped:
            await rollout(kept, client, group_size=1)
    failure = classify(dropped.value)
    assert failure.reason == ENV_UNAVAILABLE and "closed" in failure.detail


def test_options_are_checked_at_start_up() -> None:
    with pytest.raises(ConfigError, match="unknown options"):
        make_env("openenv:http://127.0.0.1:9", colour="red")
    with pytest.raises(ConfigError, match="a server the worker starts"):
        make_env("openenv:http://127.0.0.1:9", python=sys.executable)
    with pytest.raises(ConfigError, match="no module"):
        make_env("openenv:no_such_env_package.server.app")
    with pytest.raises(ConfigError, match="URL"):
        make_env("openenv:not a module/")
    with pytest.raises(ConfigError, match="seed"):
        make_env("openenv:http://127.0.0.1:9", reset_options={"seed": 1})
    with pytest.raises(ConfigError, match="names no function"):
        make_env("openenv:http://127.0.0.1:9", action="no_such_module:parse")


def _closed_port() -> int:
    from tests.redis_server import free_port

    return free_port()


@pytest.mark.slow
async def test_a_worker_killed_mid_episode_leaves_no_session_and_its_job_runs_again(
        plain: EnvServer, redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    """``rollq workers --env openenv:URL`` killed with SIGKILL while both sessions of a
    group are open: the env server is back to 0 open sessions within its session timeout
    (at once, in fact: the OS closes a dead process's sockets), and the job, still in arq's
    queue, runs again on a second worker after the job timeout and is published once,
    nothing dead-lettered."""
    env = make_env(f"openenv:{plain.url}", size=2)
    await Publisher(real_redis, RUN).register()
    await enqueue_positions(redis_server.url, RUN, env.name, [1])
    slow = FakeVLLM(max_model_len=4096, latency_s=60.0)  # the episodes wait on the model
    async with serve_fake(slow) as inference:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollq", "workers", "--redis-url", redis_server.url,
            "--run", RUN, "--env", f"openenv:{plain.url}", "--env-option", "size=2",
            "--inference", inference, "--group-size", "2", "--concurrency", "1",
            "--job-timeout-s", "4", cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            await until(lambda: plain.capacity()["active_sessions"] == 2,
                        "the episodes to start")
        finally:
            child.kill()  # SIGKILL: no shutdown, no session closed by the worker
            await child.wait()
    # within the server's session timeout (2 s) and a round of its reaper (5 s), with
    # room for a loaded machine
    await until(lambda: plain.capacity()["active_sessions"] == 0, "the sessions to close",
                timeout_s=30)
    fake = FakeVLLM(max_model_len=4096)
    fake.responder = bisector
    worker = build_worker(
        redis_url=redis_server.url, run=RUN, env_factory=lambda: env,
        inference_urls=[fake.base_url], model=None, sampling=SamplingParams(max_tokens=8),
        group_size=2, concurrency=1, job_timeout_s=4.0, max_tries=3, request_timeout_s=5,
        timeout_margin_s=1.0, burst=True, retry_base_s=0.01, transport=fake_transport(fake))
    try:  # the burst worker waits for arq to release the killed try (job timeout + 15 s)
        await asyncio.wait_for(worker.main(), 60)
    finally:
        await close_worker(worker)
    [group] = [decode_trajectory(f) for _, f in
               await real_redis.xrange(stream_key(RUN, 0, "traj"))]
    assert group.group_id == f"{RUN}:{env.name}:1" and group.metadata["seed"] == 1
    assert [c.turn_rewards for c in group.completions] == [replayed(1, [
        m["content"] for m in c.messages or [] if m["role"] == "assistant"])
        for c in group.completions]
    assert await dead_letters(real_redis) == {}
