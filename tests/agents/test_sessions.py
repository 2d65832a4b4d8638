"""External agent sessions on ``rollq gateway --sessions``, on a real redis-server: an
unmodified ``openai`` agent outside rollq's workers opens a group, is captured call by call
in Redis, and its group reaches the traj stream (and the scorers); kill -9 of the gateway
process mid-episode loses nothing; a retried call is captured once; an abandoned session
is a counted dead letter; opening is admitted under the staleness budget."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import join_trajectories
from rollq.ops.cli import main
from rollq.ops.connections import open_redis
from rollq.ops.gateway.app import create_app
from rollq.ops.local.cluster import LocalCluster
from rollq.ops.roles import run_scorer
from rollq.ops.settings import CommonSettings, GatewaySettings, ScorerSettings
from rollq.ops.status import collect_status
from rollq.producers.sessions import SessionHost
from rollq.schemas import decode_dead, decode_scored, decode_trajectory
from rollq.schemas.keys import counters_key, partition_of, session_key, stream_key
from tests.agents.agents import CALCULATOR, QUESTIONS, calculator_episode
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import assert_exactly_served, tool_script
from tests.agents.pipeline import ENV_SCORE_ONLY
from tests.producers.fake_vllm import fake_transport
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer, free_port

RUN = "ext"


@contextlib.asynccontextmanager
async def sessions_gateway(fake: AgentFakeVLLM, redis: aioredis.Redis,
                           **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway with ``--sessions`` in-process (ASGI) on the test's Redis."""
    app = create_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny", run=RUN,
                                     sessions=True, **settings),
                     transport=fake_transport(fake), redis=redis)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://gw.test") as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


def agent(http: httpx.AsyncClient, base_url: str, **options: Any) -> openai.AsyncOpenAI:
    """An unmodified ``openai`` client on the in-process gateway."""
    transport = httpx.ASGITransport(app=http.app)  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport), **options)


async def open_group(http: httpx.AsyncClient, size: int = 1, **body: Any) -> dict[str, Any]:
    response = await http.post("/sessions", json={"env": "calc", "group_size": size,
                                                  "row": {"answer": "20"}, **body})
    assert response.status_code == 200, response.text
    opened: dict[str, Any] = response.json()
    return opened


async def traj_groups(redis: aioredis.Redis) -> list[Any]:
    return [decode_trajectory(fields)
            for _, fields in await redis.xrange(stream_key(RUN, 0, "traj"))]


async def test_a_group_of_sessions_is_captured_and_published_with_its_rewards(
        real_redis: aioredis.Redis) -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    async with sessions_gateway(fake, real_redis) as http:
        opened = await open_group(http, 2)
        assert [s["session_id"] for s in opened["sessions"]] == [
            f"{opened['group_id']}.0", f"{opened['group_id']}.1"]
        rewards = []
        for session in opened["sessions"]:
            async with agent(http, session["base_url"]) as client:
                rewards.append(await calculator_episode(client, QUESTIONS[1]))
        assert await traj_groups(real_redis) == []  # nothing published before the closes
        first = (await http.post(f"/sessions/{opened['sessions'][0]['session_id']}/close",
                                 json={"reward": 1.0})).json()
        beyond = await http.post(f"/sessions/{opened['group_id']}.2/close", json={})
        assert beyond.status_code == 404, beyond.text
        closed_call = await http.post(f"{opened['sessions'][0]['base_url']}/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}]})
        assert closed_call.status_code == 409, closed_call.text
        assert (first["closed"], first["entry_id"]) == (1, None)
        last = (await http.post(f"/sessions/{opened['sessions'][1]['session_id']}/close",
                                json={"reward": 0.0, "metadata": {"turns": 3}})).json()
        again = (await http.post(f"/sessions/{opened['sessions'][1]['session_id']}/close",
                                 json={"reward": 0.0})).json()
        gone = await http.post(f"{opened['sessions'][0]['base_url']}/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]})
    assert rewards == [1.0, 1.0]
    assert last["entry_id"] is not None and again["entry_id"] == last["entry_id"]
    assert (last["closed"], last["group_size"], again["closed"]) == (2, 2, None)
    assert gone.status_code == 404 and "published" in gone.json()["error"]["message"]
    [group] = await traj_groups(real_redis)
    assert (group.group_id, group.env, group.metadata["answer"]) == (
        opened["group_id"], "calc", "20")
    assert [c.info["env_score"] for c in group.completions] == [1.0, 0.0]
    assert group.completions[1].info["episode_metadata"] == {"turns": 3}
    assert [c.info["capture"]["calls"] for c in group.completions] == [3, 3]
    assert_exactly_served(list(group.completions), group.prompt_ids.tolist(), fake.replies)
    assert await real_redis.keys(f"*session:{opened['group_id']}:calls*") == []


async def test_a_retried_call_is_captured_once(real_redis: aioredis.Redis) -> None:
    """The same ``Idempotency-Key`` (a retry after a lost answer, or two at once) is
    generated once and answered from the record."""
    fake = AgentFakeVLLM()
    async with sessions_gateway(fake, real_redis) as http:
        opened = await open_group(http)
        [session] = opened["sessions"]
        messages = [{"role": "user", "content": "What is 6*7?"}]
        async with agent(http, session["base_url"]) as client:
            first = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                extra_headers={"Idempotency-Key": "call-1"})
            retried = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                extra_headers={"Idempotency-Key": "call-1"})
            racing = await asyncio.gather(*[client.chat.completions.create(
                model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                extra_headers={"Idempotency-Key": "call-2"}) for _ in range(3)])
            other = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8)  # type: ignore[arg-type]
            by_index = [await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                extra_headers={"Rollq-Call-Index": str(position)}) for position in (0, 3, 3)]
            with pytest.raises(openai.ConflictError, match="only 4 calls"):
                await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                    extra_headers={"Rollq-Call-Index": "9"})
        host: SessionHost = http.app.state.sessions  # type: ignore[attr-defined]
        replayed = host.counts.replayed
        calls = await real_redis.lrange(
            session_key(RUN, 0, opened["group_id"], "calls:0"), 0, -1)
    assert retried.model_dump() == first.model_dump()
    assert len({r.choices[0].message.content for r in racing}) == 1
    assert by_index[0].model_dump() == first.model_dump()
    assert by_index[2].model_dump() == by_index[1].model_dump()
    # generated: call-1, call-2 (once for three requests), the unkeyed call, index 3
    assert len(fake.replies) == 4 and len(calls) == 4 and replayed == 5
    assert other.choices[0].message.content is not None


async def test_a_retry_goes_ahead_once_a_killed_tries_claim_lapses(
        real_redis: aioredis.Redis) -> None:
    """A try whose gateway process was killed mid-generation left its claim on the key:
    it lapses (it was renewed only while the try ran), and the retry is made, once."""
    fake = AgentFakeVLLM()
    async with sessions_gateway(fake, real_redis) as http:
        opened = await open_group(http)
        [session] = opened["sessions"]
        claim = session_key(RUN, 0, opened["group_id"], "claim:0:k")
        await real_redis.set(claim, b"1", px=300)  # the killed try's claim
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answers = [await http.post(f"{session['base_url']}/chat/completions", json=body,
                                   headers={"Idempotency-Key": "k"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json() == answers[1].json() and len(fake.replies) == 1


async def test_an_abandoned_session_ends_as_a_counted_dead_letter(
        real_redis: aioredis.Redis, redis_server: RedisServer,
        capsys: Any) -> None:
    fake = AgentFakeVLLM()
    async with sessions_gateway(fake, real_redis, session_ttl_s=60) as http:
        opened = await open_group(http, 2)
        [kept, abandoned] = opened["sessions"]
        await http.post(f"{kept['base_url']}/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}]})
        await http.post(f"/sessions/{kept['session_id']}/close", json={"reward": 1.0})
        host: SessionHost = http.app.state.sessions  # type: ignore[attr-defined]
        now = await real_redis.time()
        assert await host.expire(now=now[0] + 30) == []  # not idle long enough
        assert await host.expire(now=now[0] + 61) == [opened["group_id"]]
        assert await host.expire(now=now[0] + 122) == []  # once
        late = await http.post(f"/sessions/{abandoned['session_id']}/close", json={})
        page = (await http.get("/metrics")).text
    assert late.status_code == 404 and "dead-lettered" in late.json()["error"]["message"]
    [(_, fields)] = await real_redis.xrange(stream_key(RUN, 0, "dead"))
    letter = decode_dead(fields)
    assert letter.reason == "session_expired"
    assert abandoned["session_id"] in letter.detail and kept["session_id"] not in letter.detail
    counters = await real_redis.hgetall(counters_key(RUN, 0))
    assert counters[b"drop:session_expired"] == b"1"
    assert await traj_groups(real_redis) == []
    assert await real_redis.keys(f"*session:{opened['group_id']}:group") == []
    assert 'rollq_gateway_session_events_total{outcome="expired"' in page
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["dead", "list", "--redis-url", redis_server.url,
                                          "--run", RUN]) == 0
    assert "session_expired" in capsys.readouterr().out
    await asyncio.to_thread(main, ["dead", "requeue", "--all", "--yes", "--redis-url",
                                   redis_server.url, "--run", RUN])
    assert "external session group" in "".join(capsys.readouterr())
    assert await real_redis.xlen(stream_key(RUN, 0, "dead")) == 1  # refused, kept


async def test_opening_is_admitted_under_the_staleness_budget(
        real_redis: aioredis.Redis) -> None:
    """``(max_staleness + version + 1) × batch_groups`` groups may be outstanding: one
    here; the next open is refused with 429 and Retry-After until a slot frees."""
    fake = AgentFakeVLLM()
    async with sessions_gateway(fake, real_redis, max_staleness=0, batch_groups=1,
                                retry_after_s=7) as http:
        opened = await open_group(http, 4, group_id="g-1")
        again = await open_group(http, 4, group_id="g-1")  # a retried open: the same group
        refused = await http.post("/sessions", json={"env": "calc"})
        accounting = (await collect_status(real_redis, RUN)).accounting
        host: SessionHost = http.app.state.sessions  # type: ignore[attr-defined]
        now = await real_redis.time()
        await host.expire(now=now[0] + 10_000)  # the slot is freed by the dead letter
        admitted = await http.post("/sessions", json={"env": "calc"})
    assert again["sessions"] == opened["sessions"] and again["opened"] is False
    assert refused.status_code == 429 and refused.headers["retry-after"] == "7"
    assert "no admission slot" in refused.json()["error"]["message"]
    assert admitted.status_code == 200
    assert accounting is not None and accounting.sessions == 1
    assert accounting.unaccounted == 0  # an open group is in flight, not lost
    assert await real_redis.hget(f"rollq:{{{RUN}}}:state", "admitted") == b"2"


@pytest.mark.slow  # a gateway process killed and restarted
async def test_kill_9_of_the_gateway_mid_episode_loses_nothing(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    """``rollq gateway --sessions`` killed with SIGKILL after an episode's first call: a
    new process on the same address continues the session (the next call splices onto
    the first, one sequence), the close publishes the group, and the scorers score it."""
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with serve_fake(fake) as upstream:
        command = [sys.executable, "-m", "rollq", "gateway", "--sessions", "--port",
                   str(port), "--inference", upstream, "--model", "rollq-tiny",
                   "--redis-url", redis_server.url, "--run", RUN, "--log-format", "json"]
        async with httpx.AsyncClient(base_url=base) as http:
            first = await _start(command, http)
            try:
                opened = (await http.post("/sessions", json={
                    "env": "calc", "row": {"answer": "20"}})).json()
                [session] = opened["sessions"]
                messages: list[dict[str, Any]] = [
                    {"role": "user", "content": QUESTIONS[1]}]
                async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x",
                                              max_retries=0) as client:
                    reply = await client.chat.completions.create(
                        model="m", messages=messages, tools=[CALCULATOR],  # type: ignore[arg-type,list-item]
                        max_tokens=96)
                    first.kill()  # SIGKILL: no shutdown, nothing flushed
                    await first.wait()
                    second = await _start(command, http)
                    try:
                        for result in ("30", "20"):
                            message = reply.choices[0].message
                            messages.append(message.model_dump(exclude_none=True))
                            messages.append({"role": "tool", "content": result,
                                             "tool_call_id": message.tool_calls[0].id
                                             if message.tool_calls else "t"})
                            reply = await client.chat.completions.create(
                                model="m", messages=messages,  # type: ignore[arg-type]
                                tools=[CALCULATOR], max_tokens=96)  # type: ignore[list-item]
                        closed = (await http.post(f"/sessions/{session['session_id']}/close",
                                                  json={"reward": 1.0})).json()
                    finally:
                        second.send_signal(signal.SIGTERM)
                        await asyncio.wait_for(second.communicate(), 30)
            finally:
                if first.returncode is None:
                    first.kill()
                    await first.wait()
    assert first.returncode == -signal.SIGKILL and second.returncode == 0
    assert reply.choices[0].message.content == "The answer is 20"
    [group] = await traj_groups(real_redis)
    assert closed["entry_id"] is not None and group.group_id == opened["group_id"]
    [completion] = group.completions
    assert completion.info["calls"] == [0, 1, 2]  # one sequence across the two processes
    assert_exactly_served([completion], group.prompt_ids.tolist(), fake.replies)
    config = tmp_path / "reward.yaml"
    config.write_text(json.dumps(ENV_SCORE_ONLY))
    stage = await run_scorer(ScorerSettings(redis_url=redis_server.url, run=RUN,
                                            reward_config=config, processes=1),
                             asyncio.Event(), burst=True)
    assert stage.forwarded == 1
    key = stream_key(RUN, 0, "scored")
    [fields] = await join_trajectories(real_redis, [(key, f) for _, f in
                                                    await real_redis.xrange(key)])
    assert not isinstance(fields, str), fields
    scored = decode_scored(fields)
    assert scored.trajectory.group_id == opened["group_id"]
    assert scored.scores[0].reward == 1.0


async def _start(command: list[str], http: httpx.AsyncClient) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    async with asyncio.timeout(60):
        while process.returncode is None:
            try:
                if (await http.get("/health")).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    output = await process.stdout.read() if process.stdout else b""
    raise AssertionError(f"rollq gateway exited {process.returncode}: {output.decode()[-2000:]}")


async def test_sessions_on_a_redis_cluster(redis_cluster: LocalCluster) -> None:
    """Every script of a session group touches keys of one slot (its partition's hash
    tag): open, calls, the publishing close and an expiry work on a Redis Cluster."""
    client = open_redis(CommonSettings(redis_url=redis_cluster.url))
    run = f"ext-{uuid.uuid4().hex[:6]}"
    fake = AgentFakeVLLM()
    try:
        app = create_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny",
                                         run=run, partitions=4, sessions=True),
                         transport=fake_transport(fake), redis=client)
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw.test") as http:
            groups = [(await http.post("/sessions", json={"env": "calc"})).json()
                      for _ in range(6)]
            for opened in groups[:5]:
                [session] = opened["sessions"]
                answer = await http.post(
                    f"{session['base_url']}/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    headers={"Idempotency-Key": "k"})
                assert answer.status_code == 200, answer.text
                closed = await http.post(f"/sessions/{session['session_id']}/close",
                                         json={"reward": 1.0})
                assert closed.json()["entry_id"], closed.text
            host: SessionHost = app.state.sessions
            assert await host.expire(now=time.time() + 10_000) == [groups[5]["group_id"]]
        published = {partition_of(g["group_id"], 4) for g in groups[:5]}
        lengths = {p: await client.xlen(stream_key(run, p, "traj")) for p in range(4)}
        assert sum(lengths.values()) == 5 and {p for p, n in lengths.items() if n} == published
        dead = stream_key(run, partition_of(groups[5]["group_id"], 4), "dead")
        assert await client.xlen(dead) == 1
    finally:
        await client.aclose()
