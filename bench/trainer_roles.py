"""(b) of ``bench.trainer`` with ``--processes``: each role in its own OS process (spawn),
as rollq is deployed. What one role process does (rollq's publisher, scorer stage or
trainer; raw's producer or consumer), and the run of a set of them: every process sets up
and reports ready, then all start at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.bus_workload import RAW_TRAJ, Result, _raw_consume
from bench.common import report_ready, report_role, run_role_processes
from bench.rollouts import RUN, grpo_scored, make_groups
from bench.trainer_common import (
    REWARD,
    SCORER_CONCURRENCY,
    Shape,
    _client,
    _StageUntil,
    publish_all,
    scorer_reader,
    train_all,
)
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings, pad_groups
from rollq.ops.logging import configure_logging
from rollq.producers.publisher import Publisher
from rollq.schemas import encode
from rollq.schemas.decoding import decode_scored_columns


@dataclass(frozen=True)
class RoleJob:
    """What one role process of a ``--processes`` run does (pickled to a spawned child)."""

    role: str
    """``publish``, ``score`` or ``train`` (rollq); ``produce`` or ``consume`` (raw)."""
    url: str
    shape: Shape
    batch_groups: int
    read_batch: int


def _role_main(job: RoleJob, messages: Any, start: Any) -> None:
    """Entry point of a role process: set up, report ``ready``, wait for ``start``, run,
    report ``done`` with its figures (or ``error`` with the traceback)."""
    configure_logging("json", "warning")
    report_role(job.role, messages, lambda: asyncio.run(_role(job, messages, start)))


async def _role(job: RoleJob, messages: Any, start: Any) -> dict[str, float]:
    """Run one role; ``first``/``last`` are ``time.monotonic()`` stamps (CLOCK_MONOTONIC is
    system-wide on Linux, so stamps of different processes compare)."""
    shape, total = job.shape, job.shape.groups
    client = _client(job.url)
    report: dict[str, float] = {}
    try:
        if job.role in ("publish", "produce"):
            groups = make_groups(total, shape.group_size, shape.seq_len, shape.prompt_len,
                                 shape.short_text)
            payloads = [encode(g) for g in groups]  # also warms the codec
            publisher = Publisher(client, RUN)
            if job.role == "publish":
                await publisher.register()
            report_ready(messages, job.role)
            start.wait()
            cpu = time.process_time()
            report["first"] = time.monotonic()
            if job.role == "publish":
                await publish_all(publisher, groups)
            else:
                for fields in payloads:
                    await client.xadd(RAW_TRAJ, fields)  # type: ignore[arg-type]
        elif job.role == "score":
            config = RewardConfig.from_mapping(REWARD)
            async with RewardBridge(config) as bridge:
                scorer = Scorer(bridge, config_fingerprint(config), client)
                warm = make_groups(1, shape.group_size, shape.seq_len, shape.prompt_len,
                                   shape.short_text)[0]
                await scorer.score(warm)
                reader = scorer_reader(client)
                stop = asyncio.Event()
                stage = _StageUntil(total, stop, reader, scorer, concurrency=SCORER_CONCURRENCY)
                await reader.ensure_groups()
                report_ready(messages, job.role)
                start.wait()
                cpu = time.process_time()
                await stage.run(stop)
        elif job.role == "train":
            settings = TrainerClientSettings(batch_groups=job.batch_groups, block_ms=100,
                                             max_staleness=None)
            rng = np.random.default_rng(1)
            warm_groups = make_groups(job.batch_groups, shape.group_size, shape.seq_len,
                                      shape.prompt_len, shape.short_text)
            pad_groups([decode_scored_columns(encode(grpo_scored(g, rng))) for g in warm_groups])
            async with TrainerClient(client, run=RUN, consumer="bench", settings=settings) as tc:
                report_ready(messages, job.role)
                start.wait()
                cpu = time.process_time()
                await train_all(tc, total, job.batch_groups)
                report["last"] = time.monotonic()
        elif job.role == "consume":
            await client.xgroup_create(RAW_TRAJ, "g", id="0", mkstream=True)
            report_ready(messages, job.role)
            start.wait()
            cpu = time.process_time()
            report["last"] = await _raw_consume(client, RAW_TRAJ, "g", total, job.read_batch)
        else:
            raise ValueError(f"unknown role {job.role!r}")
        report["cpu"] = time.process_time() - cpu
    finally:
        await client.aclose()
    return report


@dataclass
class ProcessesResult(Result):
    role_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each role process over the run."""


def run_processes(url: str, shape: Shape, roles: Sequence[str], batch_groups: int,
                  read_batch: int) -> ProcessesResult:
    """One spawned process per role; all set up first, then started at once. Wall from the
    first publish (XADD) to the last ack; CPU summed over the role processes."""
    jobs = [RoleJob(role, url, shape, batch_groups, read_batch) for role in roles]
    reports = run_role_processes(_role_main, jobs)
    first = min(r["first"] for r in reports.values() if "first" in r)
    last = max(r["last"] for r in reports.values() if "last" in r)
    role_cpu = {role: r["cpu"] for role, r in reports.items()}
    return ProcessesResult(last - first, shape.groups, client_cpu_s=sum(role_cpu.values()),
                           role_cpu_s=role_cpu)


async def run_in_processes(url: str, shape: Shape, roles: Sequence[str], batch_groups: int,
                           read_batch: int) -> ProcessesResult:
    client = _client(url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    return await asyncio.to_thread(run_processes, url, shape, roles, batch_groups, read_batch)
