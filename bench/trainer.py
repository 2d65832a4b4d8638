"""Trainer SDK: ``next_batch`` latency, and the end-to-end bus against raw Redis.

On a redis-server this benchmark starts itself (loopback, persistence off):

(a) next_batch latency. 64 scored groups of 16 x 2048 completion tokens (256 prompt
    tokens, GRPO advantages, ~2 KB of text per completion) are XADDed to the run's scored
    stream before the clock starts; a ``TrainerClient`` then calls
    ``next_batch(groups=8)`` + ``batch.ack()`` until the 64 are trained, and the buffer is
    refilled (new group ids, stream trimmed) for the next round. One sample = one
    ``next_batch`` call: whatever it does (XREADGROUP of the groups the batch still lacks,
    at most ``read_count``; decode, dedup check, padding the 8 groups into the numpy
    arrays). Calls that read and calls served from the client's queue alone are shown
    apart; a ``read_count=8`` row is the control. ``ack`` (ledger record + counted acks)
    is timed apart. Target: p99 <= 25 ms. The client runs with ``prefetch=False``: with
    no training step between calls, a prefetch would hide only part of that work.

(b) end-to-end bus, groups/s, all roles concurrently on one asyncio loop, each on its own
    client (as bench/bus.py): ``Publisher.publish`` one group at a time -> a ``Stage`` with
    the real ``Scorer`` and a ``RewardBridge`` of ``format`` (preset think) +
    ``length_bounty`` (inline), wired as ``ops.roles.run_scorer`` (count = concurrency = 16)
    -> ``TrainerClient.next_batch(groups=8)`` + ``ack``. The clock runs from the first
    publish to the last ack. Against, in the same run: raw redis-py with the exact bytes of
    ``encode(group)`` pre-encoded, one task XADDing them one by one and one XREADGROUP
    ``COUNT 16`` + XACK per batch (bench/bus.py ``raw``; ``raw2hop`` adds the scored hop with
    zero Python work, for context). Shapes: 8 completions x 64 tokens, ~120 B of text each
    (targets: >= 1,500 groups/s and >= 0.4 of raw); then 16 x 2048 (+256 prompt), ~2 KB of
    text each (target: >= 0.5 of raw; the structural limit is ~0.67, three transfers of
    the group's bytes against raw's two), 384 groups a run (``--big-groups``): with the 96
    of earlier versions a raw run lasted ~60 ms and its rate swung by half between runs.

    ``--processes`` adds the same runs with each role in its own OS process (spawn), as
    rollq is deployed: ``rollq/procs`` (publisher | scorer stage | trainer) against
    ``raw/procs`` (producer | consumer). Every process sets up (clients, consumer groups,
    payloads, a warm-up of its codec path) and reports ready; then all start at once. Wall
    runs from the first publish (XADD) to the last ack (``time.monotonic``, system-wide
    on Linux); client CPU is the sum of the role processes' CPU time.

(c) each role alone, the shapes of (b): in this process, one after the other, the
    publisher fills the traj stream, the scorer stage scores all of it, the trainer trains
    all of it (as in (b)); raw's producer fills its stream, its consumer reads it. Per role:
    its CPU, redis-server's CPU and the wall time per group, and the rate it runs at alone.
    What (b)'s ratio is made of: the CPU every role and Redis spend on a group together
    (what bounds a run on cores that all roles share), and the slowest role's rate alone
    (what bounds a run where each role has a core of its own and Redis is idle).

(prefetch) what a training step waits for. Per shape (16 x 2048 with 256 prompt tokens,
    then 8 x 64), a scored stream is filled with real parts (``Publisher`` -> scorer
    ``Stage``, as (c)) with the groups of ``--warmup + --steps + 1`` batches, then a
    ``SyncTrainerClient`` runs the loop a training script runs: ``next_batch(groups=8)``,
    a step of ``--step-ms`` (``time.sleep``: it releases the GIL, as a GPU step does),
    ``ack``. The first ``--warmup`` steps are not counted. Wait = the time the caller
    blocks in ``next_batch`` (perf_counter around the blocking call: the client's own
    ``stats.wait_seconds`` is shown beside it); step = wall time of one whole iteration.
    With ``prefetch`` on and off, interleaved, ``--runs`` times each; a fresh stream per
    run. Target: wait p99 <= 2 ms with prefetch (median of the runs).

Run from the repository root:  python -m bench.trainer  [--runs 3 ...]
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

from bench.bus_workload import Result, run_raw
from bench.common import BenchRedis, median_of, payload_bytes, print_table, redis_cpu
from bench.rollouts import RUN, grpo_scored, make_group, make_groups
from bench.trainer_alone import part_c
from bench.trainer_common import (
    REWARD,
    SCORED,
    SCORER_CONCURRENCY,
    Shape,
    _client,
    _shapes,
    pct,
    publish_all,
    scorer_reader,
    train_all,
)
from bench.trainer_prefetch import part_prefetch
from bench.trainer_roles import ProcessesResult, run_in_processes
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.stage import Stage
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings, pad_groups
from rollq.ops.logging import configure_logging
from rollq.producers.publisher import Publisher
from rollq.schemas import Fields, TrajectoryGroup, decode_scored, encode
from rollq.schemas.decoding import decode_scored_columns

TARGET_P99_MS = 25.0
TARGET_GROUPS_PER_S = 1500.0
TARGET_RATIO = 0.4
"""8x64: a floor on groups/s and on the ratio to raw 1-hop."""
TARGET_BIG_RATIO = 0.5
"""16x2048: the ratio to raw 1-hop (the structural limit is ~0.67: three transfers of the
group's bytes against raw's two; goal 0.6)."""


# ------------------------------------------------------------------- (a) next_batch latency


@dataclass
class LatencyRun:
    next_batch_ms: list[float]
    reading_ms: list[float]
    """Calls that read from Redis (the queue did not hold a full batch)."""
    queued_ms: list[float]
    """Calls served from the client's queue."""
    ack_ms: list[float]


async def latency_run(url: str, payloads: list[Fields], batch_groups: int, read_count: int,
                      rounds: int) -> LatencyRun:
    """``rounds`` x (XADD len(payloads) entries; next_batch + ack until they are consumed)."""
    client = _client(url)
    out = LatencyRun([], [], [], [])
    try:
        await client.flushall()
        settings = TrainerClientSettings(batch_groups=batch_groups, read_count=read_count,
                                         block_ms=100, max_staleness=None, prefetch=False)
        async with TrainerClient(client, run=RUN, consumer="bench", settings=settings) as tc:
            for _ in range(rounds):
                pipe = client.pipeline(transaction=False)
                for fields in payloads:  # a fresh group id: the trainer dedups by group id
                    pipe.xadd(SCORED, {**fields,  # type: ignore[dict-item]
                                       b"group_id": uuid.uuid4().hex.encode()})
                await pipe.execute()
                consumed = 0
                while consumed < len(payloads):
                    queued = len(tc._books.queue) >= batch_groups  # bench-only peek: read?
                    started = time.perf_counter()
                    batch = await tc.next_batch(groups=batch_groups)
                    took = (time.perf_counter() - started) * 1e3
                    out.next_batch_ms.append(took)
                    (out.queued_ms if queued else out.reading_ms).append(took)
                    started = time.perf_counter()
                    await batch.ack()
                    out.ack_ms.append((time.perf_counter() - started) * 1e3)
                    consumed += len(batch)
                    del batch
                await client.xtrim(SCORED, maxlen=0)
    finally:
        await client.aclose()
    return out


def component_costs(payloads: list[Fields], batch_groups: int,
                    repeat: int = 5) -> dict[str, str]:
    """Serial ms of the pieces of a next_batch, as the client does them: decode one group
    (every check; its columns kept), pad one batch from the columns; and, for context,
    ``decode_scored`` (the same checks, then the models ``Batch.groups`` assembles when
    read) and the padding of the same batch from models."""

    def timed(work: Callable[[], Any], per: int) -> str:
        started = time.perf_counter()
        for _ in range(repeat):
            work()
        return f"{(time.perf_counter() - started) / (repeat * per) * 1e3:.3f}"

    columns = [decode_scored_columns(f) for f in payloads]
    models = [c.group() for c in columns]
    batch = columns[:batch_groups]
    return {
        "decode to columns, per group": timed(
            lambda: [decode_scored_columns(f) for f in payloads], len(payloads)),
        f"pad_groups of {batch_groups} groups (columns)": timed(lambda: pad_groups(batch), 1),
        "decode_scored (columns, then models), per group": timed(
            lambda: [decode_scored(f) for f in payloads], len(payloads)),
        f"pad_groups of {batch_groups} groups (models)": timed(
            lambda: pad_groups(models[:batch_groups]), 1),
    }


# -------------------------------------------------------------------------- (b) end to end


async def run_rollq(url: str, groups: list[TrajectoryGroup], bridge: RewardBridge,
                    config: RewardConfig, batch_groups: int) -> Result:
    """Publisher -> Stage(Scorer) -> TrainerClient, concurrently; wall from first publish
    to last ack."""
    pub_client, stage_client, trainer_client = _client(url), _client(url), _client(url)
    stop = asyncio.Event()
    try:
        await pub_client.flushall()
        publisher = Publisher(pub_client, RUN)
        await publisher.register()
        reader = scorer_reader(stage_client)
        stage = Stage(reader, Scorer(bridge, config_fingerprint(config), stage_client),
                      concurrency=SCORER_CONCURRENCY)
        await reader.ensure_groups()
        settings = TrainerClientSettings(batch_groups=batch_groups, block_ms=100,
                                         max_staleness=None)
        total = len(groups)

        async def train(tc: TrainerClient) -> float:
            await train_all(tc, total, batch_groups)
            return time.monotonic()

        async with TrainerClient(trainer_client, run=RUN, consumer="bench",
                                 settings=settings) as tc:
            start = time.monotonic()
            stage_task = asyncio.create_task(stage.run(stop))
            _, end = await asyncio.gather(publish_all(publisher, groups), train(tc))
            stop.set()
            await stage_task
        if stage.forwarded != total:
            raise RuntimeError(f"stage forwarded {stage.forwarded} of {total} groups")
        return Result(end - start, total)
    finally:
        for c in (pub_client, stage_client, trainer_client):
            await c.aclose()


async def e2e(url: str, shape: Shape, runs: int, batch_groups: int, read_batch: int,
              bridge: RewardBridge, config: RewardConfig, profile: str | None,
              processes: bool = False) -> dict[str, list[Result]]:
    groups = make_groups(shape.groups, shape.group_size, shape.seq_len, shape.prompt_len,
                         shape.short_text)
    payloads = [encode(g) for g in groups]
    rng = np.random.default_rng(1)
    scored_payloads = [encode(grpo_scored(g, rng)) for g in groups[:16]]
    size = median_of(payload_bytes(p) for p in payloads)
    text = median_of(len(c.text.encode()) for c in groups[0].completions)
    print(f"[{shape.label}] {shape.groups} groups/run of {shape.group_size} x {shape.seq_len} "
          f"tokens (+{shape.prompt_len} prompt), ~{text:.0f} B text/completion; traj payload "
          f"{size / 1e3:,.1f} KB/group", flush=True)

    variants: dict[str, Callable[[], Coroutine[Any, Any, Result]]] = {
        "raw": lambda: run_raw(url, payloads, read_batch),
        "raw2hop": lambda: run_raw(url, payloads, read_batch, scored_payloads),
        "rollq": lambda: run_rollq(url, groups, bridge, config, batch_groups),
    }
    if processes:
        variants["raw/procs"] = lambda: run_in_processes(url, shape, ("produce", "consume"),
                                                         batch_groups, read_batch)
        variants["rollq/procs"] = lambda: run_in_processes(
            url, shape, ("publish", "score", "train"), batch_groups, read_batch)
    warm = min(len(groups), 64)
    await run_raw(url, payloads[:warm], read_batch, scored_payloads)
    await run_rollq(url, groups[:warm], bridge, config, batch_groups)
    results: dict[str, list[Result]] = {name: [] for name in variants}
    for run in range(runs):  # interleaved, so drift hits every variant alike
        for name, fn in variants.items():
            gc.collect()
            redis_before = await redis_cpu(url)
            cpu_before = time.process_time()
            result = await fn()
            if not result.client_cpu_s:  # role processes report their own CPU
                result.client_cpu_s = time.process_time() - cpu_before
            result.redis_cpu_s = await redis_cpu(url) - redis_before
            results[name].append(result)
            print(f"  run {run + 1}/{runs} {name:11s} {result.seconds:7.3f} s "
                  f"{result.groups_per_s:9.1f} groups/s  (cpu: client "
                  f"{result.client_cpu_s:.3f} s, redis {result.redis_cpu_s:.3f} s)", flush=True)
            if isinstance(result, ProcessesResult):
                print("      CPU by role: " + ", ".join(
                    f"{role} {cpu:.3f} s" for role, cpu in result.role_cpu_s.items()), flush=True)
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile(time.process_time)  # CPU time, not wall: robust to noise
        profiler.enable()
        await run_rollq(url, groups, bridge, config, batch_groups)
        profiler.disable()
        profiler.dump_stats(f"{profile}.{shape.label}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return results


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--buffered", type=int, default=64,
                        help="(a) scored groups buffered per round (default 64)")
    parser.add_argument("--batch-groups", type=int, default=8,
                        help="groups per next_batch, (a) and (b) (default 8)")
    parser.add_argument("--rounds", type=int, default=12,
                        help="(a) refills per run (default 12: 96 calls per run)")
    parser.add_argument("--groups", type=int, default=3000,
                        help="(b) small-shape groups per run (default 3000)")
    parser.add_argument("--big-groups", type=int, default=384,
                        help="(b) 16x2048 groups per run (default 384; 0 skips)")
    parser.add_argument("--group-size", type=int, default=8, help="(b) small shape: completions")
    parser.add_argument("--seq-len", type=int, default=64, help="(b) small shape: tokens")
    parser.add_argument("--read-batch", type=int, default=16,
                        help="(b) raw XREADGROUP COUNT (default 16, as the scorer's)")
    parser.add_argument("--step-ms", type=float, default=200.0,
                        help="(prefetch) simulated training step, ms (default 200)")
    parser.add_argument("--steps", type=int, default=15,
                        help="(prefetch) counted steps per run (default 15)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="(prefetch) steps per run not counted (default 2)")
    parser.add_argument("--only", choices=["a", "b", "c", "prefetch"],
                        help="run one part only")
    parser.add_argument("--processes", action="store_true",
                        help="(b) also run each role in its own OS process (spawn), as "
                             "deployed: rollq publisher / scorer stage / trainer, and raw "
                             "producer / consumer")
    parser.add_argument("--profile", metavar="FILE",
                        help="(b) cProfile one extra rollq run per shape, stats to FILE.<shape>")
    return parser.parse_args(argv)


async def part_a(url: str, args: argparse.Namespace) -> list[str]:
    rng = np.random.default_rng(2)
    groups = [make_group(rng, 16, 2048, 256, short_text=False) for _ in range(args.buffered)]
    payloads = [encode(grpo_scored(g, rng)) for g in groups]
    size = median_of(payload_bytes(p) for p in payloads)
    print(f"(a) {args.buffered} buffered scored groups of 16 x 2048 tokens (+256 prompt), "
          f"{size / 1e6:.3f} MB each; next_batch(groups={args.batch_groups}); "
          f"{args.rounds} rounds/run", flush=True)
    variants = {"read_count=64 (default)": 64, f"read_count={args.batch_groups}":
                args.batch_groups}
    await latency_run(url, payloads, args.batch_groups, 64, 1)  # warm-up
    results: dict[str, list[LatencyRun]] = {name: [] for name in variants}
    for run in range(args.runs):
        for name, read_count in variants.items():
            gc.collect()
            result = await latency_run(url, payloads, args.batch_groups, read_count, args.rounds)
            results[name].append(result)
            print(f"  run {run + 1}/{args.runs} {name:24s} next_batch p50 "
                  f"{pct(result.next_batch_ms, 50):6.1f} ms  p99 "
                  f"{pct(result.next_batch_ms, 99):6.1f} ms  max "
                  f"{max(result.next_batch_ms):6.1f} ms  (n={len(result.next_batch_ms)})",
                  flush=True)
    print()
    rows: list[list[Any]] = []
    for name, runs in results.items():
        rows.append([
            name,
            " ".join(f"{pct(r.next_batch_ms, 99):.1f}" for r in runs),
            median_of(pct(r.next_batch_ms, 50) for r in runs),
            median_of(pct(r.next_batch_ms, 99) for r in runs),
            median_of(max(r.next_batch_ms) for r in runs),
            median_of(pct(r.reading_ms, 50) for r in runs),
            median_of(pct(r.queued_ms, 50) for r in runs) if runs[0].queued_ms else "-",
            median_of(pct(r.ack_ms, 50) for r in runs),
            median_of(pct(r.ack_ms, 99) for r in runs),
        ])
    print_table(["trainer reads", "p99 ms per run", "p50 ms", "p99 ms", "max ms",
                 "reading call p50", "queued call p50", "ack p50 ms", "ack p99 ms"], rows,
                title=f"(a) next_batch(groups={args.batch_groups}) latency with "
                      f"{args.buffered} buffered 16x2048 groups, median of {args.runs} runs")
    costs = component_costs(payloads[:16], args.batch_groups)
    print_table(["piece", "ms"], [[k, v] for k, v in costs.items()],
                title="(a) serial cost of the pieces (this process, no Redis)")
    lines = []
    for name, runs in results.items():
        p99 = median_of(pct(r.next_batch_ms, 99) for r in runs)
        verdict = "OK" if p99 <= TARGET_P99_MS else "ABOVE TARGET"
        lines.append(f"(a) next_batch p99, {name}: {p99:.1f} ms (target <= "
                     f"{TARGET_P99_MS:.0f} ms) {verdict}")
    return lines


def _baseline(variant: str) -> str:
    """The raw variant a variant is compared with: per-process runs with per-process raw."""
    return "raw/procs" if variant.endswith("/procs") else "raw"


async def part_b(url: str, args: argparse.Namespace) -> list[str]:
    config = RewardConfig.from_mapping(REWARD)
    lines = []
    async with RewardBridge(config) as bridge:
        for shape in _shapes(args):
            results = await e2e(url, shape, args.runs, args.batch_groups, args.read_batch,
                                bridge, config, args.profile, args.processes)
            print()
            medians = {name: median_of(r.groups_per_s for r in runs)
                       for name, runs in results.items()}
            rows = [[
                name,
                " ".join(f"{r.groups_per_s:.0f}" for r in runs),
                medians[name],
                f"{medians[name] / medians[_baseline(name)]:.2f}",
                f"{median_of(r.client_cpu_s / r.groups * 1e3 for r in runs):.3f}",
                f"{median_of(r.redis_cpu_s / r.groups * 1e3 for r in runs):.3f}",
            ] for name, runs in results.items()]
            print_table(["variant", "groups/s per run", "median groups/s", "vs raw*",
                         "client CPU ms/group", "redis CPU ms/group"], rows,
                        title=f"(b) end-to-end bus, {shape.label} groups, {shape.groups} "
                              f"per run, median of {args.runs} runs (*: /procs variants "
                              "against raw/procs; their CPU is summed over the processes)")
            for suffix, where in (("", "one process"), ("/procs", "a process per role")):
                if "rollq" + suffix not in medians:
                    continue
                rollq, raw = medians["rollq" + suffix], medians["raw" + suffix]
                ratio = rollq / raw
                line = (f"(b) {shape.label}, {where}: rollq {rollq:,.0f} groups/s, raw "
                        f"{raw:,.0f} groups/s, ratio {ratio:.2f}")
                if shape.short_text:
                    ok = rollq >= TARGET_GROUPS_PER_S and ratio >= TARGET_RATIO
                    line += (f" (targets >= {TARGET_GROUPS_PER_S:,.0f} groups/s and >= "
                             f"{TARGET_RATIO} of raw) {'OK' if ok else 'BELOW TARGET'}")
                else:
                    ok = ratio >= TARGET_BIG_RATIO
                    line += (f" (target >= {TARGET_BIG_RATIO} of raw, goal 0.6) "
                             f"{'OK' if ok else 'BELOW TARGET'}")
                lines.append(line)
    return lines


async def main_async(args: argparse.Namespace) -> int:
    lines: list[str] = []
    with BenchRedis() as server:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"redis-server {server.version()} on 127.0.0.1:{server.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; load average {load}\n",
              flush=True)
        if args.only in (None, "a"):
            lines += await part_a(server.url, args)
        if args.only in (None, "b"):
            lines += await part_b(server.url, args)
        if args.only in (None, "c"):
            lines += await part_c(server.url, args)
        if args.only in (None, "prefetch"):
            lines += await part_prefetch(server.url, args)
    for line in lines:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging("json", "warning")  # as a deployed trainer, minus info lines
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
