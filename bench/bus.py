"""Bus throughput: raw redis-py streams vs rollq's publish -> score-forward -> train-read path.

On a redis-server this benchmark starts itself (loopback, persistence off) it measures, for
full GRPO groups (default 16 completions x 2048 tokens: int32 ids, float32 logprobs, uint8
masks, ~6 KB of text per completion):

raw      plain redis-py, the exact bytes of ``encode(group)`` pre-encoded before the clock
         starts: one producer task XADDs them one by one, one consumer task XREADGROUPs
         ``COUNT batch`` and XACKs each batch in one call. One hop, no codec.
raw2hop  (context, not the target) the same, plus the second hop rollq makes: consumer 1
         reads traj, pipelines XADD of pre-encoded scored bytes + XACK per batch, consumer 2
         reads scored and XACKs. Shows what the second hop costs with zero Python work.
rollq    ``Publisher.publish`` (encode + XADD) one group at a time, a ``Stage`` (group
         "scorers", ``count=batch``) whose transform decodes the trajectory, attaches trivial
         scores (a ``ScoredGroup``: reward 0, zero token advantages, as a scorer forwards it)
         and re-encodes it, forwarded by the exactly-once Lua script (``forward_many``), and a
         trainer reader (group "trainer", ``count=batch``) that ``decode_scored``s every
         entry to numpy and acks the batch.

All tasks of a variant run concurrently on one asyncio loop, each on its own client.
Wall time is from the first XADD/publish to the last ack of the last consumer. Groups/s and
MB/s use the trajectory payload (the bytes of ``encode(group)``) for both variants.
Redis memory per buffered token: B groups XADDed (raw) / published (rollq) with nobody
consuming, ``used_memory`` before/after and ``MEMORY USAGE`` of the stream, per completion
token; for rollq also the scored stream after a Stage forwarded them.

Run from the repository root:  python -m bench.bus  [--groups 300 --runs 3 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from bench.common import BenchRedis, median_of, payload_bytes, print_table, redis_cpu
from consumers.bus import Delivery, ReaderSettings, StreamReader
from consumers.stage import Forward, Stage
from producers.publisher import Publisher
from schemas import (
    Completion,
    Fields,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
    decode_scored,
    decode_trajectory,
    encode,
)
from schemas.keys import stream_key

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
    """What a scorer forwards, with constant rewards: every advantage zero."""
    return ScoredGroup(
        trajectory=group,
        scores=tuple(
            SequenceScore(
                reward=0.0,
                advantage=0.0,
                token_advantages=np.zeros(len(c.completion_ids), np.float32),
                components={"bench": 0.0},
            )
            for c in group.completions
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
                pipe.xadd(forward_to, forward_payloads[(done + i) % len(forward_payloads)])
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
    """The benchmark scorer: decode, attach trivial scores, encode the scored entry as the real
    scorer does, copying the trajectory's bytes (``--forward scored``)."""
    scored = trivial_scores(decode_trajectory(delivery.fields))
    return Forward(encode(scored, trajectory_fields=delivery.fields))


async def reencode_transform(delivery: Delivery) -> Forward:
    """Decode the trajectory and re-encode it unchanged (``--forward traj``)."""
    return Forward(encode(decode_trajectory(delivery.fields)))


async def run_rollq(url: str, groups: list[TrajectoryGroup], batch: int,
                    forward: str = "scored") -> Result:
    pub_client, stage_client, trainer_client = _client(url), _client(url), _client(url)
    stop = asyncio.Event()
    settings = ReaderSettings(count=batch, block_ms=BLOCK_MS)
    try:
        await pub_client.flushall()
        publisher = Publisher(pub_client, RUN)
        await publisher.register()
        transform = score_transform if forward == "scored" else reencode_transform
        decode_final = decode_scored if forward == "scored" else decode_trajectory
        stage = Stage(StreamReader(stage_client, [TRAJ], "scorers", "s1", settings), transform)
        trainer = StreamReader(trainer_client, [SCORED], "trainer", "t1", settings)
        await stage.reader.ensure_groups()
        await trainer.ensure_groups()
        total = len(groups)

        async def publish() -> None:
            for group in groups:
                await publisher.publish(group)

        async def train() -> float:
            seen: set[str] = set()
            while len(seen) < total:
                deliveries = await trainer.read()
                for delivery in deliveries:
                    seen.add(decode_final(delivery.fields).group_id)
                if deliveries:
                    await trainer.ack(deliveries)
            return time.monotonic()

        start = time.monotonic()
        stage_task = asyncio.create_task(stage.run(stop))
        _, end = await asyncio.gather(publish(), train())
        stop.set()
        await stage_task
        if stage.forwarded != total:
            raise RuntimeError(f"stage forwarded {stage.forwarded} of {total} groups")
        return Result(end - start, total)
    finally:
        for c in (pub_client, stage_client, trainer_client):
            await c.aclose()


# -------------------------------------------------------------------------------- memory




async def _used_memory(client: aioredis.Redis) -> int:
    await asyncio.sleep(0.2)  # let client query buffers shrink
    return int((await client.info("memory"))["used_memory"])


async def measure_memory(url: str, groups: list[TrajectoryGroup], payloads: list[Fields],
                         batch: int, forward: str) -> list[tuple[str, float, float]]:
    """(what, used_memory delta per token, MEMORY USAGE of the stream per token)."""
    tokens = sum(g.num_tokens for g in groups)
    client = _client(url)
    rows = []
    try:
        await client.flushall()
        before = await _used_memory(client)
        for fields in payloads:
            await client.xadd(RAW_TRAJ, fields)  # type: ignore[arg-type]
        after = await _used_memory(client)
        usage = await client.memory_usage(RAW_TRAJ, samples=0)
        rows.append(("raw XADD (traj bytes)", (after - before) / tokens, usage / tokens))

        await client.flushall()
        publisher = Publisher(client, RUN)
        await publisher.register()
        before = await _used_memory(client)
        for group in groups:
            await publisher.publish(group)
        after = await _used_memory(client)
        usage = await client.memory_usage(TRAJ, samples=0)
        rows.append(("rollq traj (Publisher)", (after - before) / tokens, usage / tokens))

        stage = Stage(StreamReader(client, [TRAJ], "scorers", "s1",
                                   ReaderSettings(count=batch, block_ms=BLOCK_MS)),
                      score_transform if forward == "scored" else reencode_transform)
        before = await _used_memory(client)
        await stage.drain()
        after = await _used_memory(client)
        usage = await client.memory_usage(SCORED, samples=0)
        rows.append((f"rollq scored (Stage, --forward {forward})",
                     (after - before) / tokens, usage / tokens))
        await client.flushall()
    finally:
        await client.aclose()
    return rows


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bus", description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=300, help="groups per run (default 300)")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per completion")
    parser.add_argument("--group-size", type=int, default=16, help="completions per group")
    parser.add_argument("--batch", type=int, default=16,
                        help="XREADGROUP COUNT for every consumer, raw and rollq (default 16)")
    parser.add_argument("--text-bytes", type=int, default=6144,
                        help="decoded text per completion, bytes (default 6144)")
    parser.add_argument("--buffered", type=int, default=100,
                        help="groups buffered for the memory measurement (default 100)")
    parser.add_argument("--forward", choices=["scored", "traj"], default="scored",
                        help="what the middle consumer forwards: a ScoredGroup with trivial "
                             "scores (default; what a scorer sends) or the re-encoded trajectory")
    parser.add_argument("--no-two-hop", action="store_true",
                        help="skip the raw two-hop context variant")
    parser.add_argument("--profile", metavar="FILE",
                        help="cProfile one extra rollq run and write the stats to FILE")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    print(f"building {args.groups} groups of {args.group_size} x {args.seq_len} tokens ...",
          flush=True)
    groups = make_groups(args.groups, args.group_size, args.seq_len, args.text_bytes)
    payloads = [encode(g) for g in groups]
    if args.forward == "scored":
        scored_payloads = [encode(trivial_scores(g)) for g in groups[:8]]
    else:
        scored_payloads = payloads[:8]
    traj_size = median_of(payload_bytes(p) for p in payloads)
    scored_size = median_of(payload_bytes(p) for p in scored_payloads)
    tokens_per_group = args.group_size * args.seq_len
    field_sizes = ", ".join(f"{k.decode()}={len(v):,}" for k, v in payloads[0].items()
                            if len(v) > 64)

    variants: list[tuple[str, Callable[[], Coroutine[Any, Any, Result]]]] = []
    with BenchRedis() as server:
        url = server.url
        variants.append(("raw", lambda: run_raw(url, payloads, args.batch)))
        if not args.no_two_hop:
            variants.append(("raw2hop", lambda: run_raw(url, payloads, args.batch,
                                                        scored_payloads)))
        variants.append(("rollq", lambda: run_rollq(url, groups, args.batch, args.forward)))

        print(f"redis-server {server.version()} on 127.0.0.1:{server.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
        print(f"payload per group: traj {traj_size / 1e6:.3f} MB ({field_sizes}); "
              f"forwarded ({args.forward}) {scored_size / 1e6:.3f} MB; "
              f"{tokens_per_group:,} completion tokens; "
              f"batch {args.batch}\n", flush=True)

        # warm-up: script load, connection setup, allocator
        warm = max(1, min(32, args.groups))
        await run_raw(url, payloads[:warm], args.batch, scored_payloads)
        await run_rollq(url, groups[:warm], args.batch, args.forward)

        results: dict[str, list[Result]] = {name: [] for name, _ in variants}
        for run in range(args.runs):  # interleaved, so drift hits every variant alike
            for name, fn in variants:
                gc.collect()
                redis_before = await redis_cpu(url)
                cpu_before = time.process_time()
                result = await fn()
                result.client_cpu_s = time.process_time() - cpu_before
                result.redis_cpu_s = await redis_cpu(url) - redis_before
                results[name].append(result)
                print(f"run {run + 1}/{args.runs} {name:8s} {result.seconds:7.3f} s  "
                      f"{result.groups_per_s:8.1f} groups/s  (cpu: client "
                      f"{result.client_cpu_s:.3f} s, redis {result.redis_cpu_s:.3f} s)", flush=True)
        print()

        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            await run_rollq(url, groups, args.batch, args.forward)
            profiler.disable()
            profiler.dump_stats(args.profile)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

        memory = await measure_memory(url, groups[: args.buffered], payloads[: args.buffered],
                                      args.batch, args.forward)

    rows = []
    medians: dict[str, float] = {}
    for name, runs in results.items():
        per_run = [r.groups_per_s for r in runs]
        medians[name] = median_of(per_run)
        rows.append([
            name,
            " ".join(f"{v:.1f}" for v in per_run),
            medians[name],
            medians[name] * traj_size / 1e6,
            medians[name] * tokens_per_group / 1e6,
            f"{medians[name] / medians['raw']:.2f}",
            f"{median_of(r.client_cpu_s / r.groups * 1e3 for r in runs):.2f}",
            f"{median_of(r.redis_cpu_s / r.groups * 1e3 for r in runs):.2f}",
        ])
    print_table(["variant", "groups/s per run", "median groups/s", "MB/s (traj payload)",
                 "Mtokens/s", "vs raw", "client CPU ms/group", "redis CPU ms/group"], rows,
                title=f"throughput, {args.groups} groups/run, median of {args.runs} runs")
    print_table(
        ["buffered entries", "used_memory B/token", "MEMORY USAGE B/token"],
        [[what, delta, usage] for what, delta, usage in memory],
        title=f"Redis memory per buffered completion token "
              f"({min(args.buffered, args.groups)} groups; payload is "
              f"{traj_size / tokens_per_group:.2f} B/token traj, "
              f"{scored_size / tokens_per_group:.2f} B/token forwarded)",
    )
    ratio = medians["rollq"] / medians["raw"]
    verdict = "OK" if ratio >= TARGET_RATIO else "BELOW TARGET"
    print(f"rollq/raw groups/s ratio: {ratio:.2f} (target >= {TARGET_RATIO}) {verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
