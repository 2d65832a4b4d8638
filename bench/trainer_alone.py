"""(c) of ``bench.trainer``: each role of (b) alone, one after the other in this process, on
a stream the role before it filled; per role its CPU, redis-server's CPU and its wall time
per group."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from bench.bus_workload import RAW_TRAJ, _raw_consume
from bench.common import median_of, print_table, redis_cpu
from bench.rollouts import RUN, make_groups
from bench.trainer_common import (
    REWARD,
    SCORER_CONCURRENCY,
    Shape,
    _client,
    _shapes,
    _StageUntil,
    publish_all,
    scorer_reader,
    train_all,
)
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import encode
from rollq.schemas.heap import freeze_heap


@dataclass
class RoleCost:
    """One role's run over a stream the role before it filled."""

    client_s: float
    """CPU seconds of this process (the role alone runs in it)."""
    redis_s: float
    """CPU seconds of redis-server over the run."""
    wall_s: float


async def _timed(url: str, work: Callable[[], Coroutine[Any, Any, Any]]) -> RoleCost:
    redis_before = await redis_cpu(url)
    cpu, wall = time.process_time(), time.perf_counter()
    await work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return RoleCost(cpu, await redis_cpu(url) - redis_before, wall)


async def roles_alone(url: str, shape: Shape, bridge: RewardBridge, config: RewardConfig,
                      batch_groups: int, read_batch: int) -> dict[str, RoleCost]:
    """Each role of (b) on its own, one after the other, in this process: the publisher
    fills the traj stream, then the scorer stage scores all of it, then the trainer trains
    all of it; raw's producer fills its stream, then its consumer reads it. Nothing else
    runs meanwhile, so each role's CPU is its own and redis-server has the other core."""
    groups = make_groups(shape.groups, shape.group_size, shape.seq_len, shape.prompt_len,
                         shape.short_text)
    payloads = [encode(g) for g in groups]
    total = len(groups)
    client = _client(url)
    costs: dict[str, RoleCost] = {}
    try:
        await client.flushall()
        publisher = Publisher(client, RUN)
        await publisher.register()
        reader = scorer_reader(client)
        await reader.ensure_groups()
        done = asyncio.Event()
        stage = _StageUntil(total, done, reader, Scorer(bridge, config_fingerprint(config),
                                                        client),
                            concurrency=SCORER_CONCURRENCY)
        settings = TrainerClientSettings(batch_groups=batch_groups, block_ms=100,
                                         max_staleness=None)
        gc.collect()

        async def produce() -> None:
            for fields in payloads:
                await client.xadd(RAW_TRAJ, fields)  # type: ignore[arg-type]

        costs["rollq publisher"] = await _timed(url, lambda: publish_all(publisher, groups))
        costs["rollq scorer stage"] = await _timed(url, lambda: stage.run(done))
        async with TrainerClient(client, run=RUN, consumer="bench", settings=settings) as tc:
            costs["rollq trainer"] = await _timed(url, lambda: train_all(tc, total,
                                                                         batch_groups))
        costs["raw producer"] = await _timed(url, produce)
        await client.xgroup_create(RAW_TRAJ, "g", id="0")
        costs["raw consumer"] = await _timed(url, lambda: _raw_consume(
            client, RAW_TRAJ, "g", total, read_batch))
    finally:
        await client.aclose()
    return costs


async def part_c(url: str, args: argparse.Namespace) -> list[str]:
    config = RewardConfig.from_mapping(REWARD)
    lines = []
    async with RewardBridge(config) as bridge:
        freeze_heap()  # as every role process of (b) does once set up
        for shape in _shapes(args):
            runs = [await roles_alone(url, shape, bridge, config, args.batch_groups,
                                      args.read_batch) for _ in range(args.runs)]
            n = shape.groups
            ms = {role: {part: median_of(getattr(run[role], part) / n * 1e3 for run in runs)
                         for part in ("client_s", "redis_s", "wall_s")} for role in runs[0]}
            rows = [[role, f"{c['client_s']:.3f}", f"{c['redis_s']:.3f}", f"{c['wall_s']:.3f}",
                     f"{1e3 / c['wall_s']:,.0f}"] for role, c in ms.items()]
            print_table(["role, alone", "client CPU ms/group", "redis CPU ms/group",
                         "wall ms/group", "groups/s alone"], rows,
                        title=f"(c) each role alone on a filled stream, {shape.label} groups, "
                              f"{n} per run, median of {args.runs} runs")
            together = {side: sum(c["client_s"] + c["redis_s"] for role, c in ms.items()
                                  if role.startswith(side)) for side in ("rollq", "raw")}
            slowest = max((role for role in ms if role.startswith("rollq")),
                          key=lambda role: ms[role]["wall_s"])
            cpus = os.cpu_count() or 1
            lines.append(
                f"(c) {shape.label}: CPU per group, every role and redis-server together: "
                f"rollq {together['rollq']:.2f} ms, raw {together['raw']:.2f} ms "
                f"({together['raw'] / together['rollq']:.2f} of rollq's); rollq on {cpus} "
                f"shared cores, every one busy: at most {cpus * 1e3 / together['rollq']:,.0f} "
                f"groups/s; alone, the slowest rollq role ({slowest}) runs "
                f"{1e3 / ms[slowest]['wall_s']:,.0f} groups/s")
    return lines
