"""Big groups: long-CoT groups (16 x 32k tokens) through the bus, end to end.

On a redis-server this benchmark starts itself (loopback, persistence off), with groups
of ``--group-size`` completions of ``--seq-len`` tokens (+ ``--prompt-len`` prompt tokens)
and ~``--chars-per-token`` bytes of reasoning text per token (a long ``<think>`` block,
the shape long-CoT policies write):

(a) Redis memory per buffered token. ``--buffered`` groups are published
    (``Publisher.publish``) and left unread; ``MEMORY USAGE`` of the traj stream (all
    samples) over the tokens it holds is the cost of a group waiting for the scorers. Then
    a scorer stage scores them all (the real ``Scorer``, reward ``format`` + ``length_bounty``)
    and the scored stream is measured the same way: what a group waiting for the trainer
    adds (a scored entry names its traj entry, it does not copy it). ``used_memory``'s
    growth is shown as a cross-check, and the entry's size against ``max_entry_bytes``.

(b) End to end, groups/s: ``Publisher.publish`` -> scorer ``Stage`` -> ``TrainerClient``
    ``next_batch`` + ``ack`` running concurrently on one loop (``bench.trainer.run_rollq``),
    against raw redis-py XADD -> XREADGROUP + XACK of the same pre-encoded bytes in the same
    run (``bench.bus.run_raw``), interleaved, ``--runs`` times.

(c) ``next_batch`` latency with ``--buffered`` scored groups waiting: one sample is one
    ``next_batch(groups=--batch-groups)`` call (read, join with the traj entries, decode,
    pad into numpy arrays); ``ack`` timed apart. Against, in the same run: raw XREADGROUP
    COUNT ``--batch-groups`` + XACK of the traj entries (the bytes a batch must carry,
    nothing decoded). The client runs with ``prefetch=False``: with no step between calls,
    a prefetch would hide only part of that work (``bench.trainer --only prefetch``
    measures what it hides from a step).

Run from the repository root:  python -m bench.big_groups  [--runs 3 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from bench.bus_workload import Result, run_raw
from bench.common import BenchRedis, median_of, payload_bytes, print_table
from bench.rollouts import RUN, make_problem, make_sentence
from bench.trainer import run_rollq
from bench.trainer_common import (
    SCORED,
    SCORER_CONCURRENCY,
    TRAJ,
    pct,
    publish_all,
    scorer_reader,
)
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.stage import Stage
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.logging import configure_logging
from rollq.ops.settings import WorkerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import Completion, Fields, TrajectoryGroup, encode

REWARD = {
    "components": [
        {"name": "format", "component": "format", "settings": {"preset": "think"}},
        {"name": "length_bounty", "component": "length_bounty"},
    ],
    "advantages": {"zero_variance": "keep"},
}


@dataclass(frozen=True)
class Shape:
    group_size: int
    seq_len: int
    prompt_len: int
    chars_per_token: float

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens of one group, as ``TrajectoryGroup.num_tokens``."""
        return self.group_size * (self.prompt_len + self.seq_len)

    @property
    def label(self) -> str:
        return f"{self.group_size}x{self.seq_len}"


def long_text(rng: np.random.Generator, chars: int, answer: str) -> str:
    """A ``<think>`` block of about ``chars`` characters, then a boxed answer."""
    steps: list[str] = []
    size = 0
    while size < chars:
        sentence = make_sentence(rng, len(steps))
        steps.append(sentence)
        size += len(sentence) + 1
    return f"<think>\n{' '.join(steps)}\n</think>\nThe answer is $\\boxed{{{answer}}}$."


def make_group(rng: np.random.Generator, shape: Shape) -> TrajectoryGroup:
    problem = make_problem(rng)
    completions = []
    for _ in range(shape.group_size):
        answer = problem.answer if rng.random() < 0.5 else problem.wrong
        completions.append(Completion(
            completion_ids=rng.integers(0, 150_000, shape.seq_len, dtype=np.int32),
            logprobs=-rng.random(shape.seq_len, dtype=np.float32) * 2,
            loss_mask=np.ones(shape.seq_len, np.uint8), policy_version=0,
            finish_reason="stop",
            text=long_text(rng, int(shape.seq_len * shape.chars_per_token), answer)))
    now = time.time()
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex, run=RUN, env="math", policy_version=0,
        prompt_ids=rng.integers(0, 150_000, shape.prompt_len, dtype=np.int32),
        prompt_text=problem.prompt, completions=tuple(completions),
        metadata={"answer": problem.gold}, created_at=now, finished_at=now)


def make_groups(shape: Shape, count: int, distinct: int = 4) -> list[TrajectoryGroup]:
    """``count`` groups with unique ids, from ``distinct`` random bases (memory)."""
    rng = np.random.default_rng(0)
    bases = [make_group(rng, shape) for _ in range(min(distinct, count))]
    return [bases[i % len(bases)].model_copy(update={"group_id": uuid.uuid4().hex})
            for i in range(count)]


def client(url: str) -> aioredis.Redis:
    made: aioredis.Redis = aioredis.Redis.from_url(url)
    return made


async def used_memory(redis: aioredis.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def stream_memory(redis: aioredis.Redis, key: str) -> int:
    return int(await redis.memory_usage(key, samples=0) or 0)


async def publish_and_score(url: str, groups: list[TrajectoryGroup], bridge: RewardBridge,
                            config: RewardConfig) -> dict[str, int]:
    """Flush, publish ``groups``, measure, score them all, measure again."""
    redis = client(url)
    try:
        await redis.flushall()
        publisher = Publisher(redis, RUN)
        await publisher.register()
        reader = scorer_reader(redis)
        await reader.ensure_groups()
        base = await used_memory(redis)
        await publish_all(publisher, groups)
        published = await used_memory(redis)
        traj = await stream_memory(redis, TRAJ)
        stage = Stage(reader, Scorer(bridge, config_fingerprint(config), redis),
                      concurrency=SCORER_CONCURRENCY)
        while stage.forwarded + stage.dropped + stage.dead_lettered < len(groups):
            await stage.drain()
        if stage.forwarded != len(groups):  # a dead letter here is a bug: say so, stop
            raise RuntimeError(f"the scorer forwarded {stage.forwarded} of {len(groups)} "
                               f"groups ({stage.dead_lettered} dead-lettered)")
        return {"traj": traj, "scored": await stream_memory(redis, SCORED),
                "used_published": published - base, "used_scored": await used_memory(redis) - base}
    finally:
        await redis.aclose()


async def part_a(url: str, args: argparse.Namespace, shape: Shape, bridge: RewardBridge,
                 config: RewardConfig) -> list[str]:
    groups = make_groups(shape, args.buffered)
    entry = payload_bytes(encode(groups[0]))
    tokens = sum(g.num_tokens for g in groups)
    memory = await publish_and_score(url, groups, bridge, config)
    cap = WorkerSettings().max_entry_bytes
    rows = [
        ["traj entry (wire bytes)", entry, entry / groups[0].num_tokens],
        ["traj stream, MEMORY USAGE", memory["traj"], memory["traj"] / tokens],
        ["scored stream, MEMORY USAGE", memory["scored"], memory["scored"] / tokens],
        ["used_memory growth, published", memory["used_published"],
         memory["used_published"] / tokens],
        ["used_memory growth, published + scored", memory["used_scored"],
         memory["used_scored"] / tokens],
    ]
    print_table(["what", "bytes", "bytes per completion token"], rows,
                title=f"(a) Redis memory, {args.buffered} buffered {shape.label} groups "
                      f"({tokens:,} completion tokens, ~{shape.chars_per_token} B text "
                      "per token)")
    per_token = (memory["traj"] + memory["scored"]) / tokens
    return [f"(a) {shape.label}: Redis memory {per_token:.2f} B per buffered completion "
            f"token (traj "
            f"{memory['traj'] / tokens:.2f} + scored {memory['scored'] / tokens:.3f}); "
            f"entry {entry / 2**20:.1f} MiB, {cap / entry:.1f}x below the default "
            f"max_entry_bytes ({cap / 2**20:.0f} MiB)"]


async def part_b(url: str, args: argparse.Namespace, shape: Shape, bridge: RewardBridge,
                 config: RewardConfig) -> list[str]:
    groups = make_groups(shape, args.groups)
    payloads: list[Fields] = [encode(g) for g in groups]
    await run_raw(url, payloads[:4], args.batch_groups)  # warm-up
    await run_rollq(url, groups[:4], bridge, config, args.batch_groups)
    results: dict[str, list[Result]] = {"raw": [], "rollq": []}
    for run in range(args.runs):  # interleaved: drift hits both alike
        for name in results:
            gc.collect()
            result = await (run_raw(url, payloads, args.batch_groups) if name == "raw" else
                            run_rollq(url, groups, bridge, config, args.batch_groups))
            results[name].append(result)
            print(f"  run {run + 1}/{args.runs} {name:6s} {result.seconds:7.2f} s "
                  f"{result.groups_per_s:7.2f} groups/s "
                  f"{result.groups_per_s * shape.tokens / 1e6:6.2f} M tokens/s", flush=True)
    ratios = [r.groups_per_s / w.groups_per_s
              for r, w in zip(results["rollq"], results["raw"], strict=True)]
    rows = [[name, " ".join(f"{r.groups_per_s:.1f}" for r in runs),
             median_of(r.groups_per_s for r in runs),
             median_of(r.groups_per_s * shape.tokens / 1e6 for r in runs)]
            for name, runs in results.items()]
    print_table(["variant", "groups/s per run", "median groups/s", "M tokens/s"], rows,
                title=f"(b) end to end, {args.groups} {shape.label} groups per run, "
                      f"trainer batches of {args.batch_groups}, median of {args.runs} runs")
    rollq = median_of(r.groups_per_s for r in results["rollq"])
    raw = median_of(r.groups_per_s for r in results["raw"])
    return [f"(b) {shape.label} end to end: rollq {rollq:.1f} groups/s, raw XADD->XREADGROUP "
            f"{raw:.1f} groups/s; rollq/raw median of per-run ratios {median_of(ratios):.2f}"]


@dataclass
class Latency:
    next_batch_ms: list[float]
    ack_ms: list[float]
    raw_ms: list[float]


async def latency_round(url: str, groups: list[TrajectoryGroup], payloads: list[Fields],
                        bridge: RewardBridge, config: RewardConfig, batch: int,
                        out: Latency) -> None:
    """Buffer ``groups`` scored, then next_batch + ack until consumed; then the raw read of
    the same traj bytes."""
    await publish_and_score(url, groups, bridge, config)
    redis = client(url)
    try:
        settings = TrainerClientSettings(batch_groups=batch, block_ms=100, max_staleness=None,
                                         prefetch=False)  # the work of one call, all of it
        async with TrainerClient(redis, run=RUN, consumer="bench", settings=settings) as tc:
            consumed = 0
            while consumed < len(groups):
                started = time.perf_counter()
                got = await tc.next_batch(groups=batch)
                out.next_batch_ms.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                await got.ack()
                out.ack_ms.append((time.perf_counter() - started) * 1e3)
                consumed += len(got)
                del got
        await redis.flushall()
        pipe = redis.pipeline(transaction=False)
        for fields in payloads:
            pipe.xadd(TRAJ, fields)  # type: ignore[arg-type]
        await pipe.execute()
        await redis.xgroup_create(TRAJ, "raw", id="0")
        done = 0
        while done < len(payloads):
            started = time.perf_counter()
            reply = await redis.xreadgroup("raw", "c", {TRAJ: ">"}, count=batch)
            ids = [entry_id for entry_id, _ in reply[0][1]]
            await redis.xack(TRAJ, "raw", *ids)
            out.raw_ms.append((time.perf_counter() - started) * 1e3)
            done += len(ids)
    finally:
        await redis.aclose()


async def part_c(url: str, args: argparse.Namespace, shape: Shape, bridge: RewardBridge,
                 config: RewardConfig) -> list[str]:
    groups = make_groups(shape, args.buffered)
    payloads = [encode(g) for g in groups]
    runs: list[Latency] = []
    for run in range(args.runs):
        out = Latency([], [], [])
        for _ in range(args.rounds):
            fresh = [g.model_copy(update={"group_id": uuid.uuid4().hex}) for g in groups]
            gc.collect()
            await latency_round(url, fresh, payloads, bridge, config, args.batch_groups, out)
        runs.append(out)
        print(f"  run {run + 1}/{args.runs} next_batch p50 {pct(out.next_batch_ms, 50):7.1f} ms "
              f"p99 {pct(out.next_batch_ms, 99):7.1f} ms; raw read p50 "
              f"{pct(out.raw_ms, 50):6.1f} ms (n={len(out.next_batch_ms)})", flush=True)
    rows = [[name, median_of(pct(getattr(r, field), 50) for r in runs),
             median_of(pct(getattr(r, field), 99) for r in runs),
             median_of(max(getattr(r, field)) for r in runs)]
            for name, field in (("next_batch", "next_batch_ms"), ("ack", "ack_ms"),
                                ("raw XREADGROUP + XACK", "raw_ms"))]
    print_table(["call", "p50 ms", "p99 ms", "max ms"], rows,
                title=f"(c) next_batch(groups={args.batch_groups}) with {args.buffered} "
                      f"scored {shape.label} groups buffered, median of {args.runs} runs")
    p50 = median_of(pct(r.next_batch_ms, 50) for r in runs)
    raw = median_of(pct(r.raw_ms, 50) for r in runs)
    tokens = args.batch_groups * shape.tokens
    return [f"(c) next_batch(groups={args.batch_groups}) of {shape.label} groups "
            f"({tokens:,} tokens): p50 {p50:.1f} ms, p99 "
            f"{median_of(pct(r.next_batch_ms, 99) for r in runs):.1f} ms; raw read of the "
            f"same traj bytes p50 {raw:.1f} ms ({p50 / raw:.1f}x)"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.big_groups",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32768, help="completion tokens")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--chars-per-token", type=float, default=3.5,
                        help="bytes of completion text per token (default 3.5)")
    parser.add_argument("--buffered", type=int, default=16,
                        help="(a), (c) groups buffered (default 16)")
    parser.add_argument("--groups", type=int, default=24, help="(b) groups per run")
    parser.add_argument("--batch-groups", type=int, default=2,
                        help="groups per next_batch and per raw read (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="(c) refills per run")
    parser.add_argument("--only", choices=["a", "b", "c"], help="run one part only")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    shape = Shape(args.group_size, args.seq_len, args.prompt_len, args.chars_per_token)
    config = RewardConfig.from_mapping(REWARD)
    lines: list[str] = []
    parts: dict[str, Any] = {"a": part_a, "b": part_b, "c": part_c}
    with BenchRedis() as server:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"redis-server {server.version()} on 127.0.0.1:{server.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; load average {load}\n",
              flush=True)
        async with RewardBridge(config) as bridge:
            for name, part in parts.items():
                if args.only in (None, name):
                    lines += await part(server.url, args, shape, bridge, config)
    for line in lines:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging("json", "warning")
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
