"""``LoopbackListener``: the in-process hub over real loopback HTTP (keep-alive, streaming,
malformed requests), and ``LocalGateway`` holding it only while episodes are open."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import openai
import pytest

from rollq.producers.inference.capture import CaptureHub, LocalGateway, Upstream
from rollq.producers.inference.capture.listener import LoopbackListener
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import pool_of


async def test_the_hub_answers_plain_http_streams_and_refuses_garbage() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        hub = CaptureHub(Upstream(pool))
        listener = LoopbackListener(hub)
        await listener.start()
        try:
            async with httpx.AsyncClient(base_url=listener.url) as http:
                opened = (await http.post("/episodes")).json()
                base = listener.url + opened["base_path"]
                async with openai.AsyncOpenAI(base_url=base, api_key="x",
                                              max_retries=0) as agent:
                    reply = await agent.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}])
                    chunks = [chunk async for chunk in await agent.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "again"}],
                        stream=True)]
                health = (await http.get("/health?verbose=1")).json()
                closed = (await http.post(f"/episodes/{opened['episode_id']}/close")).json()
            reader, writer = await asyncio.open_connection(listener.host, listener.port)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            answer = await reader.read()
            writer.close()
            await writer.wait_closed()
        finally:
            await listener.aclose()
    assert reply.choices[0].message.content == "reply 0"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "reply 1"
    assert health["episodes"] == 1
    assert closed["stats"]["calls"] == 2
    assert answer.startswith(b"HTTP/1.1 400")


async def test_the_local_gateway_listens_only_while_episodes_are_open() -> None:
    fake = AgentFakeVLLM()
    async with pool_of(fake) as pool:
        gateway = LocalGateway(CaptureHub(Upstream(pool)))
        first, second = await asyncio.gather(*(gateway.open(defaults={}, policy_version=None)
                                               for _ in range(2)))
        assert first.base_url.split("/episodes/")[0] == second.base_url.split("/episodes/")[0]
        idle = httpx.AsyncClient()  # an agent's keep-alive connection, never closed by it
        response = await idle.get(first.base_url.split("/episodes/")[0] + "/health")
        assert response.json()["episodes"] == 2
        await gateway.close(first)
        assert (await idle.get(second.base_url + "/models")).status_code == 200
        await gateway.close(second)
        try:
            await idle.get(second.base_url + "/models")
            raise AssertionError("the listener still answers after the last episode closed")
        except httpx.TransportError:
            pass
        finally:
            await idle.aclose()


async def test_a_connection_accepted_as_the_listener_stops_is_closed_with_it() -> None:
    """An agent's connection the listener accepted just before it stopped: asyncio makes
    its transport a loop turn after the accept and starts its handler two turns later,
    and a server closed in between left its socket open (Python 3.11's ``Server._attach``
    refuses a closed server's transport half-made): a file descriptor held past the event
    loop, then a ResourceWarning in whichever later test collected it (the warning two CI
    runs failed on, most likely from here). Stopping closes it, at every turn of that
    window."""
    for turns in range(9):
        listener = LoopbackListener(CaptureHub(Upstream(None)))  # type: ignore[arg-type]
        await listener.start()
        agent = socket.create_connection((listener.host, listener.port), timeout=10)
        try:
            for _ in range(turns):
                await asyncio.sleep(0)
            await listener.aclose()
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.to_thread(agent.recv, 1) == b"", turns  # closed
        finally:
            agent.close()


async def test_a_listener_whose_stop_is_cancelled_stops_all_the_same() -> None:
    """Its stop waits a few loop turns (above); a caller cancelled in them (a job timing
    out as its last episode closes) still leaves the listener closed, its port free."""
    listener = LoopbackListener(CaptureHub(Upstream(None)))  # type: ignore[arg-type]
    await listener.start()
    closing = asyncio.create_task(listener.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await asyncio.sleep(0.1)  # the shielded close runs on
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((listener.host, listener.port), timeout=10).close()
