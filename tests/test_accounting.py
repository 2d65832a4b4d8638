"""``rollq status`` accounts for every admitted group and reports the ones Redis lost."""

from __future__ import annotations

import redis.asyncio as aioredis

from rollq.ops.status import collect_status, render_status
from rollq.producers.publisher import Publisher
from rollq.producers.worker import queue_name
from rollq.schemas.keys import ADMITTED_FIELD, state_key
from tests.factories import make_group
from tests.producers.jobs import enqueue_positions
from tests.redis_server import RedisServer

RUN = "audit"


async def test_status_finds_admitted_groups_that_are_nowhere(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, RUN).register()
    await enqueue_positions(redis_server.url, RUN, "toy", range(6))
    await real_redis.hincrby(state_key(RUN), ADMITTED_FIELD, 6)
    # Two jobs finished: their groups are on the traj stream, their jobs left the queue.
    for position in range(2):
        await Publisher(real_redis, RUN).publish(
            make_group(run=RUN, group_id=f"{RUN}:toy:{position}"))
        await real_redis.zrem(queue_name(RUN), f"{RUN}:toy:{position}")
    status = await collect_status(real_redis, RUN)
    assert status.accounting is not None
    assert (status.accounting.expected, status.accounting.held) == (6, 6)
    assert status.accounting.unaccounted == 0
    assert "WARNING" not in render_status(status)

    # A crash between two AOF fsyncs lost a queued job (here: removed by hand).
    await real_redis.zrem(queue_name(RUN), f"{RUN}:toy:5")
    status = await collect_status(real_redis, RUN)
    assert status.accounting is not None and status.accounting.unaccounted == 1
    assert "WARNING: 1 admitted group(s) are in no queue, stream or dead letter" in \
        render_status(status)
    assert status.as_dict()["accounting"]["unaccounted"] == 1
