"""Issue 34's repro, as the operator ran it: one scored entry naming
``traj=1-18446744073709551615`` made ``rollq score`` exit 1 on every trim cycle (30 s).

A real scorer process runs 90 s (three trim cycles) over that entry: it never exits, and
the entry ends as exactly one dead letter. (The repro's traj entry was ``junk 1``, which
the scorer dead-letters as ``decode_error`` on its own; here it is a valid group, which the
scorer forwards, so the poison entry's letter is the only one.)

Slow on purpose (90 s of wall time, marked ``slow``): the trim runs on the scorer's own
30 s cycle, as in production.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.producers.publisher import Publisher
from rollq.schemas import decode_dead
from rollq.schemas.failures import TRAJECTORY_MISSING
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.outages.roles import QUICK_REWARD, RoleProcess

RUN = "x"
RUNNING_S = 90


@pytest.mark.slow
@pytest.mark.timeout(RUNNING_S + 60)
async def test_a_scorer_runs_90_s_over_an_overflowing_ref(make_redis_server: type,
                                                          tmp_path: Path) -> None:
    server = make_redis_server().start()
    redis = aioredis.Redis.from_url(server.url)
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK_REWARD)
    process = await RoleProcess.start("score", "--redis-url", server.url, "--run", RUN,
                                      "--reward-config", str(config), "--processes", "1")
    try:
        await process.wait_for("scorer_started")
        await Publisher(redis, RUN).publish(make_group(run=RUN, group_id="x:g:1"))
        await redis.xadd(stream_key(RUN, 0, "scored"), {
            "v": "1", "kind": "scored", "group_id": "x:g:0", "run": RUN, "env": "gsm8k",
            "policy_version": "0", "traj": "1-18446744073709551615"})
        try:
            await asyncio.wait_for(process.process.wait(), RUNNING_S)
        except TimeoutError:
            pass  # still running after 90 s: as it should
        assert process.process.returncode is None, process.lines[-5:]
        process.signal(signal.SIGTERM)
        assert await process.finish(30) == 0
    finally:
        process.kill()
    letters = [decode_dead(fields) for _, fields in
               await redis.xrange(stream_key(RUN, 0, "dead"))]
    assert [letter.reason for letter in letters] == [TRAJECTORY_MISSING]
    assert letters[0].payload[b"traj"] == b"1-18446744073709551615"
    scored = await redis.xrange(stream_key(RUN, 0, "scored"))
    assert [fields[b"group_id"] for _, fields in scored] == [b"x:g:1"]
    assert len(process.events("entry_dead_lettered")) == 1
    await redis.aclose()
