"""Issue 34's repro, as the operator ran it: one scored entry naming
``traj=1-18446744073709551615`` made ``rollq score`` exit 1 on every trim cycle (30 s).

A real scorer process runs three trim cycles over that entry: it never exits, and the entry
ends as exactly one dead letter. (The repro's traj entry was ``junk 1``, which the scorer
dead-letters as ``decode_error`` on its own; here it is a valid group, which the scorer
forwards, so the poison entry's letter is the only one.) The trim cycle is the scorer's own
``--trim-every-s``: 5 s here instead of production's 30 s (the test ran 90 s before it was a
setting); the cycles it counts are the scorer's own ``streams_trim``/``housekeeping`` rounds.
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
TRIM_EVERY_S = 5
AFTER_FIRST_S = 2 * TRIM_EVERY_S + 3
"""How long the scorer must go on after the first trim round dead-lettered the entry: two
more rounds and a margin."""


@pytest.mark.slow
@pytest.mark.timeout(AFTER_FIRST_S + 120)
async def test_a_scorer_runs_three_trim_cycles_over_an_overflowing_ref(
        make_redis_server: type, tmp_path: Path) -> None:
    server = make_redis_server().start()
    redis = aioredis.Redis.from_url(server.url)
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK_REWARD)
    process = await RoleProcess.start("score", "--redis-url", server.url, "--run", RUN,
                                      "--reward-config", str(config), "--processes", "1",
                                      "--trim-every-s", str(TRIM_EVERY_S))
    try:
        await process.wait_for("scorer_started")
        await Publisher(redis, RUN).publish(make_group(run=RUN, group_id="x:g:1"))
        await redis.xadd(stream_key(RUN, 0, "scored"), {
            "v": "1", "kind": "scored", "group_id": "x:g:0", "run": RUN, "env": "gsm8k",
            "policy_version": "0", "traj": "1-18446744073709551615"})
        await process.wait_for("entry_dead_lettered")  # the first trim round found it
        try:
            await asyncio.wait_for(process.process.wait(), AFTER_FIRST_S)
        except TimeoutError:
            pass  # still running after three trim cycles: as it should
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
