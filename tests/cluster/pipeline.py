"""The whole pipeline on a real local Redis Cluster (data plane) and a plain redis-server
(control plane: arq's queue): feeder, workers on the fake vLLM, scorer and the SDK trainer,
all in one event loop, with an optional failover of a master in the middle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from structlog.testing import capture_logs

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.connections import open_queue_redis, open_redis
from rollq.ops.dead import letters
from rollq.ops.roles import run_feeder, run_scorer, run_workers
from rollq.ops.settings import CommonSettings, FeederSettings, ScorerSettings, WorkerSettings
from rollq.ops.status import RunStatus, collect_status
from rollq.producers.worker import job_id
from rollq.schemas.outage import OutageRider
from tests.producers.fake_vllm import FakeVLLM, fake_transport

PARTITIONS = 6
REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
          "advantages: {zero_variance: keep}\n")


@dataclass
class Outcome:
    admitted: int
    expected_ids: set[str]
    trained: Counter[str] = field(default_factory=Counter)
    status: RunStatus | None = None
    failovers: int = 0
    outages: dict[str, int] = field(default_factory=dict)
    """``redis_outage_ended`` log lines by role: the outages the roles rode out."""


def write_dataset(path: Path, items: int) -> Path:
    path.write_text("".join(orjson.dumps({"question": f"What is {i} + 1?",
                                          "answer": f"#### {i + 1}"}).decode() + "\n"
                            for i in range(items)))
    return path


async def run_pipeline(tmp_path: Path, *, data_url: str, queue_url: str, run: str, items: int,
                       mid_run: Callable[[], Awaitable[None]] | None = None,
                       at_trained: int = 0, **common: Any) -> Outcome:
    """Feed ``items`` groups through every role; ``mid_run`` is awaited (while the roles
    keep running) once ``at_trained`` groups were trained. Returns when the feeder has
    admitted everything and no group is in flight any more (``rollq status`` accounting)."""
    with contextlib.ExitStack() as stack:
        outcome = await _run(stack, tmp_path, data_url=data_url, queue_url=queue_url, run=run,
                             items=items, mid_run=mid_run, at_trained=at_trained, **common)
        return outcome


async def _run(stack: contextlib.ExitStack, tmp_path: Path, *, data_url: str, queue_url: str,
               run: str, items: int, mid_run: Callable[[], Awaitable[None]] | None,
               at_trained: int, **common: Any) -> Outcome:
    source = write_dataset(tmp_path / "items.jsonl", items)
    reward = tmp_path / "reward.yaml"
    reward.write_text(REWARD)
    shared = dict(redis_url=data_url, queue_url=queue_url, run=run, partitions=PARTITIONS,
                  redis_give_up_s=120.0, **common)
    env = dict(env="gsm8k", env_options={"source": str(source)})
    fake = FakeVLLM()
    stop = asyncio.Event()
    roles = [
        asyncio.create_task(run_feeder(FeederSettings(
            **shared, **env, epochs=1, batch_groups=4, max_staleness=1, poll_s=0.05), stop)),
        asyncio.create_task(run_workers(WorkerSettings(
            **shared, **env, inference=[fake.base_url], group_size=2, max_tokens=8,
            concurrency=4), transport=fake_transport(fake))),
        asyncio.create_task(run_scorer(ScorerSettings(
            **shared, reward_config=reward, processes=1, block_ms=200), stop)),
    ]
    settings = CommonSettings(**shared)
    data, queue = open_redis(settings), open_queue_redis(settings)
    outcome = Outcome(admitted=0, expected_ids=set())
    logs = stack.enter_context(capture_logs())
    rider = OutageRider(give_up_s=120.0, what="status", log=structlog.get_logger("test"))
    try:
        async with TrainerClient(data, run=run, consumer="t0", settings=TrainerClientSettings(
                block_ms=100, batch_groups=4, max_staleness=None, partitions=PARTITIONS,
                redis_give_up_s=120.0)) as trainer:
            step = 0
            while True:
                failed = [t for t in roles if t.done()]
                if any(t.exception() for t in failed if not t.cancelled()):
                    raise next(t.exception() for t in failed if t.exception())  # type: ignore[misc]
                batch = await trainer.next_batch(groups=4, timeout_s=0.5)
                if batch.groups:
                    outcome.trained.update(batch.group_ids)
                    await trainer.ack(batch)
                    step += 1
                    await trainer.publish_policy(step, tmp_path)
                if mid_run is not None and sum(outcome.trained.values()) >= at_trained:
                    await mid_run()
                    mid_run = None
                    outcome.failovers += 1
                status = await rider.call(lambda: collect_status(data, run, queue=queue))
                accounting = status.accounting
                if (roles[0].done() and accounting is not None and accounting.held == 0
                        and status.admitted == items):
                    assert mid_run is None, f"the run ended before {at_trained} were trained"
                    outcome.status = status
                    break
    finally:
        stop.set()
        if not roles[1].done():  # the workers' graceful stop (their loop's SIGTERM handler)
            os.kill(os.getpid(), signal.SIGTERM)
        for task in roles:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 60)
        await data.aclose()
        await queue.aclose()
    assert outcome.status is not None
    outcome.outages = dict(Counter(str(e.get("role")) for e in logs
                                   if e["event"] == "redis_outage_ended"))
    outcome.admitted = outcome.status.admitted
    outcome.expected_ids = {job_id(run, "gsm8k", p) for p in range(outcome.admitted)}
    return outcome


async def dead_group_ids(data_url: str, run: str) -> set[str]:
    """Group ids of the run's dead letters."""
    redis = open_redis(CommonSettings(redis_url=data_url, run=run))
    try:
        return {letter.group_id for letter in await letters(redis, run) if letter.group_id}
    finally:
        await redis.aclose()
