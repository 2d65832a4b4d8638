"""The workers watch the queue's server on its own (issue 34: they PINGed the data plane
while arq's server was down, logging hundreds of 0.1 s "outages" and never giving up).

The data plane and arq's queue are two redis-servers; only the queue's is killed and stays
down. The workers log one ``redis_outage_started`` line (naming the queue connection) and
give up ``redis_give_up_s`` (10 s) after the outage began: exit 69 after 10–12 s.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from rollq.ops.cli.common import Exit
from tests.outages.roles import RoleProcess

GIVE_UP_S = 10


@pytest.mark.slow
async def test_workers_give_up_on_the_queue_server_alone(make_redis_server: type,
                                                         inference: str) -> None:
    data = make_redis_server().start()
    queue = make_redis_server().start()
    process = await RoleProcess.start(
        "workers", "--redis-url", data.url, "--run", "queued", "--inference", inference,
        ROLLQ_QUEUE_URL=queue.url, ROLLQ_REDIS_GIVE_UP_S=str(GIVE_UP_S))
    try:
        await process.wait_for("worker_started")
        await asyncio.to_thread(queue.kill)
        killed = time.monotonic()
        code = await process.finish(GIVE_UP_S + 20)
        took = time.monotonic() - killed
    finally:
        process.kill()
    assert code == Exit.UNAVAILABLE, process.lines[-5:]
    # gave up at GIVE_UP_S, then exited (quietly within ~1 s; room for a loaded machine)
    assert GIVE_UP_S <= took <= GIVE_UP_S + 8, f"exited {took:.1f} s after the kill"
    started = process.events("redis_outage_started")
    assert len(started) == 1, started
    assert started[0]["connection"] == "queue"
    assert not process.events("redis_outage_ended")
    assert len(process.events("redis_outage_gave_up")) == 1


@pytest.mark.slow
async def test_a_queue_restart_is_one_outage_of_the_queue(make_redis_server: type,
                                                          inference: str) -> None:
    data = make_redis_server().start()
    queue = make_redis_server(appendonly=True).start()
    process = await RoleProcess.start(
        "workers", "--redis-url", data.url, "--run", "queued", "--inference", inference,
        ROLLQ_QUEUE_URL=queue.url, ROLLQ_REDIS_GIVE_UP_S="60")
    try:
        await process.wait_for("worker_started")
        await asyncio.to_thread(queue.kill)
        await process.wait_for("redis_outage_started")
        await asyncio.sleep(2.0)  # down for a while, data plane up all along
        await asyncio.to_thread(queue.start)
        ended = await process.wait_for("redis_outage_ended")
        process.signal(signal.SIGTERM)
        code = await process.finish(30)
    finally:
        process.kill()
    assert code == Exit.OK
    assert ended["connection"] == "queue" and ended["seconds"] >= 2.0
    assert len(process.events("redis_outage_started")) == 1
    assert len(process.events("redis_outage_ended")) == 1
