"""The bus benchmark's workload, shared by ``bench.bus`` (one node) and
``bench.bus_cluster`` (a local Redis Cluster): synthetic groups, the raw-Redis baseline
client and rollq's publish -> score stage -> trainer read pipeline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from rollq.consumers.bus import Delivery, ReaderSettings, StreamReader
from rollq.consumers.scorer.advantages import broadcast_advantages
from rollq.consumers.stage import Forward, Stage
from rollq.producers.publisher import Publisher
from rollq.schemas import (
    Completion,
    Fields,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
    decode_scored,
    decode_trajectory,
    encode,
)
from rollq.schemas.keys import stream_key, stream_keys

RUN = "bench"
TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
RAW_TRAJ = "rawbench:traj"
RAW_SCORED = "rawbench:scored"
TARGET_RATIO = 0.5
BLOCK_MS = 100

_WORDS = (
    "the of and to in is that for it as with was on be by this are or an from at which we "
    "can if so then let x y n answer step value sum equation solve therefore number total "
    "first second next compute because each since two three four five final result check"
).split()


# --------------------------------------------------------------------------------- payload


def _text(rng: np.random.Generator, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = _WORDS[int(rng.integers(len(_WORDS)))]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


def make_group(rng: np.random.Generator, group_size: int, seq_len: int, text_bytes: int,
               prompt_len: int = 256) -> TrajectoryGroup:
    now = time.time()
    completions = tuple(
        Completion(
            completion_ids=rng.integers(0, 150_000, seq_len, dtype=np.int32),
            logprobs=-rng.random(seq_len, dtype=np.float32) * 4,
            loss_mask=np.ones(seq_len, np.uint8),
            policy_version=3,
            finish_reason="stop",
            text=_text(rng, text_bytes),
            info={"turns": 1},
        )
        for _ in range(group_size)
    )
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        run=RUN,
        env="gsm8k",
        policy_version=3,
        prompt_ids=rng.integers(0, 150_000, prompt_len, dtype=np.int32),
        prompt_text=_text(rng, 4 * prompt_len),
        completions=completions,
        metadata={"answer": "42", "index": int(rng.integers(10_000))},
        created_at=now,
        finished_at=now,
    )


def make_groups(count: int, group_size: int, seq_len: int, text_bytes: int,
                distinct: int = 8) -> list[TrajectoryGroup]:
    """``count`` groups with unique ids; token arrays come from ``distinct`` random bases."""
    rng = np.random.default_rng(0)
    bases = [make_group(rng, group_size, seq_len, text_bytes) for _ in range(min(distinct, count))]
    return [
        bases[i % len(bases)].model_copy(update={"group_id": uuid.uuid4().hex})
        for i in range(count)
    ]


def trivial_scores(group: TrajectoryGroup) -> ScoredGroup:
    """What a scorer forwards, with constant rewards: every advantage zero (per token too,
    broadcast as the scorer does)."""
    zeros = np.zeros(len(group.completions), np.float32)
    token_advantages = broadcast_advantages(zeros, [len(c.completion_ids)
                                                    for c in group.completions])
    return ScoredGroup(
        trajectory=group,
        scores=tuple(
            SequenceScore(reward=0.0, advantage=0.0, token_advantages=t,
                          components={"bench": 0.0})
            for t in token_advantages
        ),
        weights={"bench": 1.0},
        reward_config="bench",
        scored_at=time.time(),
    )


# ------------------------------------------------------------------------------ variants


@dataclass
class Result:
    seconds: float
    groups: int
    client_cpu_s: float = 0.0
    """CPU time of this (single-threaded) benchmark process during the run."""
    redis_cpu_s: float = 0.0
    """CPU time of redis-server during the run (INFO cpu, user + sys)."""

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


def _client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url)


async def _raw_consume(client: aioredis.Redis, source: str, group: str, total: int,
                       batch: int, forward_to: str | None = None,
                       forward_payloads: list[Fields] | None = None) -> float:
    """XREADGROUP COUNT batch + one XACK per batch (optionally XADD downstream first);
    returns the monotonic time of the last ack."""
    done = 0
    while done < total:
        reply = await client.xreadgroup(group, "c1", {source: ">"}, count=batch, block=BLOCK_MS)
        if not reply:
            continue
        entries = reply[0][1]
        ids = [entry_id for entry_id, _ in entries]
        if forward_to is not None and forward_payloads is not None:
            pipe = client.pipeline(transaction=False)
            for i in range(len(ids)):
                copy = forward_payloads[(done + i) % len(forward_payloads)]
                pipe.xadd(forward_to, copy)  # type: ignore[arg-type]
            pipe.xack(source, group, *ids)
            await pipe.execute()
        else:
            await client.xack(source, group, *ids)
        done += len(ids)
    return time.monotonic()


async def run_raw(url: str, payloads: list[Fields], batch: int,
                  scored_payloads: list[Fields] | None = None) -> Result:
    """One hop (or two when ``scored_payloads`` is given) of pre-encoded bytes."""
    producer, consumer, consumer2 = _client(url), _client(url), _client(url)
    try:
        await producer.flushall()
        await producer.xgroup_create(RAW_TRAJ, "g", id="0", mkstream=True)
        await producer.xgroup_create(RAW_SCORED, "g2", id="0", mkstream=True)
        total = len(payloads)

        async def produce() -> None:
            for fields in payloads:
                await producer.xadd(RAW_TRAJ, fields)  # type: ignore[arg-type]

        start = time.monotonic()
        tasks: list[Coroutine[Any, Any, Any]] = [produce()]
        if scored_payloads is None:
            tasks.append(_raw_consume(consumer, RAW_TRAJ, "g", total, batch))
        else:
            tasks.append(_raw_consume(consumer, RAW_TRAJ, "g", total, batch,
                                      RAW_SCORED, scored_payloads))
            tasks.append(_raw_consume(consumer2, RAW_SCORED, "g2", total, batch))
        results = await asyncio.gather(*tasks)
        return Result(max(r for r in results if r is not None) - start, total)
    finally:
        for c in (producer, consumer, consumer2):
            await c.aclose()


async def score_transform(delivery: Delivery) -> Forward:
    """The benchmark scorer: decode, attach trivial scores, and encode the scored entry as
    the real scorer does (reference form: it names the traj entry)."""
    scored = trivial_scores(decode_trajectory(delivery.fields))
    return Forward(encode(scored, trajectory_id=delivery.entry_id))


async def _score_until(stage: Stage, total: int) -> None:
    """The scorer loop of ``ops.roles.run_scorer``, until ``total`` groups are forwarded."""
    while stage.forwarded < total:
        deliveries = await stage.reader.next_deliveries()
        if deliveries:
            await stage.process(deliveries)


async def _train_until(trainer: StreamReader, total: int) -> float:
    """Read scored entries (joined with their trajectories), decode them to numpy and ack,
    until ``total`` distinct groups; returns the monotonic time of the last ack."""
    seen: set[str] = set()
    while len(seen) < total:
        deliveries = await trainer.read()
        for delivery in deliveries:
            seen.add(decode_scored(delivery.fields).group_id)
        if deliveries:
            await trainer.ack(deliveries)
    return time.monotonic()


def _stage(client: aioredis.Redis, batch: int, partitions: int = 1) -> Stage:
    return Stage(StreamReader(client, stream_keys(RUN, partitions, "traj"), "scorers", "s1",
                              ReaderSettings(count=batch, block_ms=BLOCK_MS)), score_transform)


def _trainer(client: aioredis.Redis, batch: int, partitions: int = 1) -> StreamReader:
    return StreamReader(client, stream_keys(RUN, partitions, "scored"), "trainer", "t1",
                        ReaderSettings(count=batch, block_ms=BLOCK_MS), join_trajectories=True)


async def run_rollq(url: str, groups: list[TrajectoryGroup], batch: int, *,
                    partitions: int = 1,
                    connect: Callable[[str], aioredis.Redis] = _client) -> Result:
    """rollq's three roles on this process's loop, each on its own client (``connect(url)``),
    over ``partitions`` partitions (``bench.bus_cluster`` runs it on a cluster)."""
    clients = [connect(url) for _ in range(3)]
    pub_client, stage_client, trainer_client = clients
    try:
        await pub_client.flushall()  # a cluster client sends it to every master
        publisher = Publisher(pub_client, RUN, partitions)
        await publisher.register()
        stage = _stage(stage_client, batch, partitions)
        trainer = _trainer(trainer_client, batch, partitions)
        await stage.reader.ensure_groups()
        await trainer.ensure_groups()
        total = len(groups)

        async def publish() -> None:
            for group in groups:
                await publisher.publish(group)

        start = time.monotonic()
        _, _, end = await asyncio.gather(publish(), _score_until(stage, total),
                                         _train_until(trainer, total))
        if stage.forwarded != total:
            raise RuntimeError(f"stage forwarded {stage.forwarded} of {total} groups")
        return Result(end - start, total)
    finally:
        for c in clients:
            await c.aclose()


# ----------------------------------------------------------------- one OS process per role
