"""What the parts of ``bench.trainer`` share: the run's streams, the reward, the scorer
stage's concurrency, the shapes of (b) and (c), the pieces the parts build their roles from
(a Redis client, the scorer stage's reader, a stage that stops after a count, the publishing
and training loops) and the percentile their figures are read with."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from bench.rollouts import RUN
from rollq.consumers.bus import Delivery, ReaderSettings, StreamReader
from rollq.consumers.stage import Stage
from rollq.consumers.trainer import TrainerClient
from rollq.producers.publisher import Publisher
from rollq.schemas import TrajectoryGroup
from rollq.schemas.keys import stream_key

TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
SCORER_CONCURRENCY = 16
REWARD = {
    "components": [
        {"name": "format", "component": "format", "settings": {"preset": "think"}},
        {"name": "length_bounty", "component": "length_bounty"},
    ],
    "advantages": {"zero_variance": "keep"},
}


def _client(url: str) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(url)
    return client


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


@dataclass(frozen=True)
class Shape:
    group_size: int
    seq_len: int
    prompt_len: int
    short_text: bool
    groups: int

    @property
    def label(self) -> str:
        return f"{self.group_size}x{self.seq_len}"


def _shapes(args: argparse.Namespace) -> list[Shape]:
    """The shapes of (b) and (c): the small one, then 16 x 2048 unless ``--big-groups 0``."""
    shapes = [Shape(args.group_size, args.seq_len, 32, True, args.groups)]
    if args.big_groups:
        shapes.append(Shape(16, 2048, 256, False, args.big_groups))
    return shapes


def scorer_reader(client: aioredis.Redis) -> StreamReader:
    """The scorer stage's reader of the run's traj stream, as ``ops.roles.run_scorer``
    sizes it (``count`` = the stage's concurrency)."""
    return StreamReader(client, [TRAJ], "scorers", "scorer-bench",
                        ReaderSettings(count=SCORER_CONCURRENCY, block_ms=100))


async def publish_all(publisher: Publisher, groups: Sequence[TrajectoryGroup]) -> None:
    """``Publisher.publish`` each group, one after the other."""
    for group in groups:
        await publisher.publish(group)


async def train_all(tc: TrainerClient, total: int, batch_groups: int) -> None:
    """``next_batch`` + ``ack`` until ``total`` groups are trained."""
    consumed = 0
    while consumed < total:
        batch = await tc.next_batch(groups=min(batch_groups, total - consumed))
        await batch.ack()
        consumed += len(batch)


class _StageUntil(Stage):
    """A ``Stage`` that sets ``done`` once it has forwarded ``total`` entries."""

    def __init__(self, total: int, done: asyncio.Event, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.total = total
        self.done = done

    async def process(self, deliveries: list[Delivery]) -> None:
        await super().process(deliveries)
        if self.forwarded >= self.total:
            self.done.set()
