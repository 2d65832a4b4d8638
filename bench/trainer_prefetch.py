"""(prefetch) of ``bench.trainer``: what a training step waits for in ``next_batch``, with
the client's prefetch on and off, on a scored stream the real publisher and scorer stage
filled."""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from dataclasses import dataclass

from bench.common import median_of
from bench.rollouts import RUN, make_groups
from bench.trainer_common import (
    REWARD,
    SCORER_CONCURRENCY,
    Shape,
    _client,
    _StageUntil,
    pct,
    publish_all,
    scorer_reader,
)
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings
from rollq.producers.publisher import Publisher

TARGET_WAIT_P99_MS = 2.0
"""(prefetch): the p99 of a training step's wait in ``next_batch`` with prefetch on."""


PREFETCH_SHAPES = (Shape(16, 2048, 256, False, 0), Shape(8, 64, 32, True, 0))
"""(prefetch) shapes; ``groups`` is set per run from the steps."""


@dataclass
class StepRun:
    """One training loop of (prefetch), counted steps only."""

    wait_ms: list[float]
    """Per step: the caller's wait in ``next_batch``."""
    step_ms: list[float]
    """Per step: the whole iteration (``next_batch``, the step, ``ack``)."""
    stats_wait_ms: float
    """The client's ``stats.wait_seconds``, mean over the counted steps."""


async def fill_scored(url: str, shape: Shape, count: int, bridge: RewardBridge,
                      config: RewardConfig) -> None:
    """An empty Redis, then ``count`` groups of ``shape`` published and scored by the real
    roles: the run's scored stream holds ``count`` groups for the trainer."""
    groups = make_groups(count, shape.group_size, shape.seq_len, shape.prompt_len,
                         shape.short_text)
    client = _client(url)
    try:
        await client.flushall()
        publisher = Publisher(client, RUN)
        await publisher.register()
        reader = scorer_reader(client)
        await reader.ensure_groups()
        await publish_all(publisher, groups)
        done = asyncio.Event()
        stage = _StageUntil(count, done, reader, Scorer(bridge, config_fingerprint(config),
                                                        client),
                            concurrency=SCORER_CONCURRENCY)
        await stage.run(done)
    finally:
        await client.aclose()


def train_steps(url: str, prefetch: bool, batch_groups: int, warmup: int, steps: int,
                step_s: float) -> StepRun:
    """The training loop of a script through ``SyncTrainerClient`` (blocking: run it in a
    thread of its own, as a training script is)."""
    # max_staleness as deployed: the hand-out looks the run's version up (nothing here is
    # stale: every group is of version 0, and no one publishes)
    settings = TrainerClientSettings(batch_groups=batch_groups, block_ms=100,
                                     prefetch=prefetch)
    out = StepRun([], [], 0.0)
    with SyncTrainerClient(url, run=RUN, consumer="bench", settings=settings) as tc:
        waits = tc.client.stats.wait_seconds
        counted_from = (0.0, 0)
        for step in range(warmup + steps):
            if step == warmup:
                counted_from = (waits.sum, waits.count)
            started = time.perf_counter()
            batch = tc.next_batch(groups=batch_groups)
            waited = time.perf_counter() - started
            if len(batch) != batch_groups:
                raise RuntimeError(f"step {step}: {len(batch)} of {batch_groups} groups")
            time.sleep(step_s)  # the GPU step: the GIL is free meanwhile
            batch.ack()
            del batch
            if step >= warmup:
                out.wait_ms.append(waited * 1e3)
                out.step_ms.append((time.perf_counter() - started) * 1e3)
        out.stats_wait_ms = (waits.sum - counted_from[0]) / (waits.count - counted_from[1]) * 1e3
    return out


async def part_prefetch(url: str, args: argparse.Namespace) -> list[str]:
    config = RewardConfig.from_mapping(REWARD)
    count = (args.warmup + args.steps + 1) * args.batch_groups  # +1: the last prefetch
    lines = []
    async with RewardBridge(config) as bridge:
        for shape in PREFETCH_SHAPES:
            print(f"(prefetch) [{shape.label}] {count} scored groups per run; "
                  f"next_batch(groups={args.batch_groups}), step {args.step_ms:.0f} ms, "
                  f"{args.steps} steps after {args.warmup}", flush=True)
            runs: dict[bool, list[StepRun]] = {True: [], False: []}
            for run in range(args.runs):
                for prefetch in (True, False):
                    await fill_scored(url, shape, count, bridge, config)
                    gc.collect()
                    result = await asyncio.to_thread(
                        train_steps, url, prefetch, args.batch_groups, args.warmup,
                        args.steps, args.step_ms / 1e3)
                    runs[prefetch].append(result)
                    print(f"  run {run + 1}/{args.runs} prefetch {'on ' if prefetch else 'off'}"
                          f" step p50 {pct(result.step_ms, 50):7.1f} ms, wait p50 "
                          f"{pct(result.wait_ms, 50):6.2f} ms p99 {pct(result.wait_ms, 99):6.2f}"
                          f" ms max {max(result.wait_ms):6.2f} ms (stats mean "
                          f"{result.stats_wait_ms:6.2f} ms)", flush=True)
            step = median_of(pct(r.step_ms, 50) for r in runs[True])
            wait = {on: (median_of(pct(r.wait_ms, 50) for r in runs[on]),
                         median_of(pct(r.wait_ms, 99) for r in runs[on])) for on in runs}
            verdict = "OK" if wait[True][1] <= TARGET_WAIT_P99_MS else "ABOVE TARGET"
            print(f"  wait p99 with prefetch {wait[True][1]:.2f} ms (target <= "
                  f"{TARGET_WAIT_P99_MS:.0f} ms) {verdict}\n", flush=True)
            lines.append(f"prefetch {shape.label}: step {step:.1f} ms, wait p50 "
                         f"{wait[True][0]:.2f} ms p99 {wait[True][1]:.2f} ms (without "
                         f"prefetch: {wait[False][0]:.2f} / {wait[False][1]:.2f})")
    return lines
