"""Bus throughput: raw redis-py streams vs rollq's publish -> score -> train-read path.

On a redis-server this benchmark starts itself (loopback, persistence off) it measures, for
full GRPO groups (default 16 completions x 2048 tokens: int32 ids, float32 logprobs, uint8
masks, ~6 KB of text per completion):

raw      plain redis-py, the exact bytes of ``encode(group)`` pre-encoded before the clock
         starts: a producer XADDs them one by one, a consumer XREADGROUPs ``COUNT batch``
         and XACKs each batch in one call. One hop, no codec.
raw2hop  (context) the same, plus a second hop carrying the whole group again: a relay
         reads traj and pipelines an XADD of pre-encoded scored bytes (trajectory copied
         in) + XACK per batch; a consumer reads that stream. What a bus that copies each
         group into its scored stream pays for the second hop, with zero Python work.
rollq    ``Publisher.publish`` (encode + XADD) one group at a time; a ``Stage`` (group
         "scorers", ``count=batch``) whose transform decodes the trajectory, attaches
         trivial scores (a ``ScoredGroup``: reward 0, zero advantages) and encodes the
         scored entry as the scorer does, in reference form (scores + the traj entry's id),
         forwarded exactly once (``forward_many``); and a trainer reader (group "trainer",
         ``count=batch``, ``join_trajectories``) that joins every scored entry with its traj
         entry, ``decode_scored``s it to numpy and acks the batch.

Two shapes, both by default (``--mode``):
processes  each role in its own OS process (spawned; all set up, then started at once),
           as rollq is deployed: env workers, scorers and trainers are separate processes.
           The verdict is taken here.
loop       every role of a variant on one asyncio loop in this process, each on its own
           client: all client work shares one core.
The verdict is rollq/raw in processes mode, taken run by run (raw and rollq run back to
back, the first of the two alternating between runs, so the machine's drift hits both
sides of a ratio alike) and medianed over the runs; the ratio of the two medians is printed
beside it. On a noisy machine the paired ratio is the steadier of the two: raw alone can
move by 2x between runs a minute apart.
Wall time runs from the first XADD/publish to the last ack of the last consumer
(``time.monotonic``, system-wide on Linux). Groups/s and MB/s use the trajectory payload
(the bytes of ``encode(group)``) for every variant. Client CPU is this process's CPU (loop)
or the sum over the role processes (processes); redis CPU is the server's, from INFO.
Redis memory per buffered token: B groups XADDed (raw) / published (rollq) with nobody
consuming, ``used_memory`` before/after and ``MEMORY USAGE`` of the stream, per completion
token; for rollq also the scored stream after a Stage forwarded them.

Run from the repository root:  python -m bench.bus  [--groups 300 --runs 9 --mode both]
With ``--cluster``: a local Redis Cluster vs one node instead (``bench.bus_cluster``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from bench.bus_workload import (
    RAW_SCORED,
    RAW_TRAJ,
    RUN,
    SCORED,
    TARGET_RATIO,
    TRAJ,
    Result,
    _client,
    _raw_consume,
    _score_until,
    _stage,
    _train_until,
    _trainer,
    make_groups,
    run_raw,
    run_rollq,
    score_transform,
    trivial_scores,
)
from bench.common import (
    BenchRedis,
    median_of,
    payload_bytes,
    print_table,
    redis_cpu,
    report_ready,
    report_role,
    run_role_processes,
)
from rollq.consumers.bus import Delivery
from rollq.producers.publisher import Publisher
from rollq.schemas import (
    Fields,
    TrajectoryGroup,
    decode_scored,
    encode,
)

ROLES = {
    "raw": ("produce", "consume"),
    "raw2hop": ("produce", "relay", "consume2"),
    "rollq": ("publish", "score", "train"),
}


@dataclass(frozen=True)
class RoleJob:
    """One role of a ``processes`` run (pickled to a spawned child)."""

    role: str
    url: str
    groups: int
    group_size: int
    seq_len: int
    text_bytes: int
    batch: int


async def _prepare(job: RoleJob, client: aioredis.Redis) -> Callable[[], Awaitable[float]]:
    """Set a role up (payloads, consumer groups, a warm codec) and return its timed part,
    which returns its start time (producers) or the time of its last ack (consumers)."""
    total, batch = job.groups, job.batch
    sample = make_groups(8, job.group_size, job.seq_len, job.text_bytes)
    if job.role in ("produce", "publish"):
        groups = make_groups(total, job.group_size, job.seq_len, job.text_bytes)
        payloads = [encode(g) for g in groups]
        publisher = Publisher(client, RUN)
        await publisher.register()

        async def produce() -> float:
            first = time.monotonic()
            if job.role == "publish":
                for group in groups:
                    await publisher.publish(group)
            else:
                for fields in payloads:
                    await client.xadd(RAW_TRAJ, fields)  # type: ignore[arg-type]
            return first

        return produce
    if job.role in ("consume", "relay", "consume2"):
        source, group = (RAW_SCORED, "g2") if job.role == "consume2" else (RAW_TRAJ, "g")
        await client.xgroup_create(source, group, id="0", mkstream=True)
        copies = [encode(trivial_scores(g)) for g in sample]  # the trajectory inline

        async def consume() -> float:
            if job.role == "relay":
                return await _raw_consume(client, source, group, total, batch, RAW_SCORED, copies)
            return await _raw_consume(client, source, group, total, batch)

        return consume
    if job.role == "score":
        stage = _stage(client, batch)
        await stage.reader.ensure_groups()
        await score_transform(Delivery(TRAJ, "0-1", encode(sample[0])))  # warm the codec

        async def score() -> float:
            await _score_until(stage, total)
            return time.monotonic()

        return score
    if job.role == "train":
        trainer = _trainer(client, batch)
        await trainer.ensure_groups()
        decode_scored(encode(trivial_scores(sample[0])))  # warm the codec
        return lambda: _train_until(trainer, total)
    raise ValueError(f"unknown role {job.role!r}")


def _role_main(job: RoleJob, messages: Any, start: Any) -> None:
    """Entry point of a role process (see ``bench.common.run_role_processes``)."""
    report_role(job.role, messages, lambda: asyncio.run(_role(job, messages, start)))


async def _role(job: RoleJob, messages: Any, start: Any) -> dict[str, float]:
    client = _client(job.url)
    try:
        timed = await _prepare(job, client)
        report_ready(messages, job.role)
        start.wait()  # blocks this loop, which has nothing else to do yet
        cpu = time.process_time()
        stamp = await timed()
        return {"at": stamp, "cpu": time.process_time() - cpu}
    finally:
        await client.aclose()


async def run_processes(url: str, variant: str, args: argparse.Namespace) -> Result:
    """``variant``'s roles, one spawned process each; wall from the producer's first XADD
    to the last consumer's last ack, client CPU summed over the role processes."""
    client = _client(url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    roles = ROLES[variant]
    jobs = [RoleJob(role, url, args.groups, args.group_size, args.seq_len, args.text_bytes,
                    args.batch) for role in roles]
    reports = await asyncio.to_thread(run_role_processes, _role_main, jobs)
    wall = reports[roles[-1]]["at"] - reports[roles[0]]["at"]
    return Result(wall, args.groups, client_cpu_s=sum(r["cpu"] for r in reports.values()))


# -------------------------------------------------------------------------------- memory


async def _used_memory(client: aioredis.Redis) -> int:
    await asyncio.sleep(0.2)  # let client query buffers shrink
    return int((await client.info("memory"))["used_memory"])


async def measure_memory(url: str, groups: list[TrajectoryGroup], payloads: list[Fields],
                         batch: int) -> list[tuple[str, float, float]]:
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

        before = await _used_memory(client)
        await _stage(client, batch).drain()
        after = await _used_memory(client)
        usage = await client.memory_usage(SCORED, samples=0)
        rows.append(("rollq scored (Stage; names traj entries)", (after - before) / tokens,
                     usage / tokens))
        await client.flushall()
    finally:
        await client.aclose()
    return rows


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bus", description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=300, help="groups per run (default 300)")
    parser.add_argument("--runs", type=int, default=9, help="runs per variant (default 9)")
    parser.add_argument("--mode", choices=["both", "processes", "loop"], default="both",
                        help="one OS process per role, all roles on one loop, or both "
                             "(default; the verdict is taken on processes)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per completion")
    parser.add_argument("--group-size", type=int, default=16, help="completions per group")
    parser.add_argument("--batch", type=int, default=16,
                        help="XREADGROUP COUNT for every consumer, raw and rollq (default 16)")
    parser.add_argument("--text-bytes", type=int, default=6144,
                        help="decoded text per completion, bytes (default 6144)")
    parser.add_argument("--buffered", type=int, default=100,
                        help="groups buffered for the memory measurement (default 100)")
    parser.add_argument("--no-two-hop", action="store_true",
                        help="skip the raw two-hop context variant")
    parser.add_argument("--cluster", action="store_true",
                        help="instead: a local Redis Cluster (3 masters + 3 replicas) vs one "
                        "node, same workload (bench.bus_cluster)")
    parser.add_argument("--partitions", type=int, default=6,
                        help="partitions of the run with --cluster (default 6)")
    parser.add_argument("--profile", metavar="FILE",
                        help="cProfile one extra loop-mode rollq run and write the stats to FILE")
    return parser.parse_args(argv)


def paired_ratios(results: dict[str, list[Result]], name: str) -> list[float]:
    """``name``'s groups/s over raw's, run by run (each pair measured back to back)."""
    return [r.groups_per_s / base.groups_per_s
            for r, base in zip(results[name], results["raw"], strict=True)]


def _table(mode: str, results: dict[str, list[Result]], args: argparse.Namespace,
           traj_size: float) -> tuple[float, float, list[float]]:
    """Print one mode's table; returns rollq/raw as the median of the per-run (paired)
    ratios, as the ratio of the medians, and the per-run ratios."""
    tokens_per_group = args.group_size * args.seq_len
    medians = {name: median_of(r.groups_per_s for r in runs) for name, runs in results.items()}
    rows = []
    for name, runs in results.items():
        rows.append([
            name,
            " ".join(f"{r.groups_per_s:.0f}" for r in runs),
            medians[name],
            medians[name] * traj_size / 1e6,
            medians[name] * tokens_per_group / 1e6,
            f"{median_of(paired_ratios(results, name)):.2f}",
            f"{median_of(r.client_cpu_s / r.groups * 1e3 for r in runs):.2f}",
            f"{median_of(r.redis_cpu_s / r.groups * 1e3 for r in runs):.2f}",
        ])
    print_table(["variant", "groups/s per run", "median groups/s", "MB/s (traj payload)",
                 "Mtokens/s", "vs raw (paired)", "client CPU ms/group", "redis CPU ms/group"],
                rows, title=f"{mode}: {args.groups} groups/run, median of {args.runs} runs")
    ratios = paired_ratios(results, "rollq")
    return median_of(ratios), medians["rollq"] / medians["raw"], ratios


async def main_async(args: argparse.Namespace) -> int:
    if args.cluster:
        from bench.bus_cluster import main_cluster

        return await main_cluster(args)
    print(f"building {args.groups} groups of {args.group_size} x {args.seq_len} tokens ...",
          flush=True)
    groups = make_groups(args.groups, args.group_size, args.seq_len, args.text_bytes)
    payloads = [encode(g) for g in groups]
    copies = [encode(trivial_scores(g)) for g in groups[:8]]
    references = [encode(trivial_scores(g), trajectory_id="1700000000000-0") for g in groups[:8]]
    traj_size = median_of(payload_bytes(p) for p in payloads)
    tokens_per_group = args.group_size * args.seq_len
    field_sizes = ", ".join(f"{k.decode()}={len(v):,}" for k, v in payloads[0].items()
                            if len(v) > 64)
    variants = [v for v in ROLES if not (v == "raw2hop" and args.no_two_hop)]
    modes = ["processes", "loop"] if args.mode == "both" else [args.mode]

    def loop_run(variant: str) -> Callable[[], Coroutine[Any, Any, Result]]:
        if variant == "raw":
            return lambda: run_raw(url, payloads, args.batch)
        if variant == "raw2hop":
            return lambda: run_raw(url, payloads, args.batch, copies)
        return lambda: run_rollq(url, groups, args.batch)

    with BenchRedis() as server:
        url = server.url
        print(f"redis-server {server.version()} on 127.0.0.1:{server.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
        print(f"payload per group: traj {traj_size / 1e6:.3f} MB ({field_sizes}); rollq's "
              f"scored entry {median_of(payload_bytes(p) for p in references) / 1e3:.1f} KB; "
              f"raw2hop's copy {median_of(payload_bytes(p) for p in copies) / 1e6:.3f} MB; "
              f"{tokens_per_group:,} completion tokens; batch {args.batch}\n", flush=True)

        # warm-up: script load, connection setup, allocator
        warm = max(1, min(32, args.groups))
        await run_raw(url, payloads[:warm], args.batch, copies)
        await run_rollq(url, groups[:warm], args.batch)

        ratios: dict[str, tuple[float, float, list[float]]] = {}
        for mode in modes:
            results: dict[str, list[Result]] = {name: [] for name in variants}
            for run in range(args.runs):
                # Interleaved, raw and rollq back to back with the first of them alternating:
                # the machine's drift hits both sides of each run's ratio alike.
                pair = ["raw", "rollq"] if run % 2 == 0 else ["rollq", "raw"]
                for name in pair + [v for v in variants if v not in pair]:
                    gc.collect()
                    redis_before = await redis_cpu(url)
                    cpu_before = time.process_time()
                    if mode == "processes":
                        result = await run_processes(url, name, args)
                    else:
                        result = await loop_run(name)()
                        result.client_cpu_s = time.process_time() - cpu_before
                    result.redis_cpu_s = await redis_cpu(url) - redis_before
                    results[name].append(result)
                    print(f"{mode} run {run + 1}/{args.runs} {name:8s} {result.seconds:7.3f} s  "
                          f"{result.groups_per_s:8.1f} groups/s  (cpu: client "
                          f"{result.client_cpu_s:.3f} s, redis {result.redis_cpu_s:.3f} s)",
                          flush=True)
            print()
            ratios[mode] = _table(mode, results, args, traj_size)

        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            await run_rollq(url, groups, args.batch)
            profiler.disable()
            profiler.dump_stats(args.profile)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

        memory = await measure_memory(url, groups[: args.buffered], payloads[: args.buffered],
                                      args.batch)

    print_table(
        ["buffered entries", "used_memory B/token", "MEMORY USAGE B/token"],
        [[what, f"{delta:.2f}", f"{usage:.2f}"] for what, delta, usage in memory],
        title=f"Redis memory per buffered completion token "
              f"({min(args.buffered, args.groups)} groups; the traj payload is "
              f"{traj_size / tokens_per_group:.2f} B/token)",
    )
    for mode, (paired, of_medians, per_run) in ratios.items():
        verdict = "OK" if paired >= TARGET_RATIO else "BELOW TARGET"
        judged = " (the verdict)" if mode == modes[0] else " (context)"
        print(f"rollq/raw groups/s, {mode}: per run {' '.join(f'{r:.2f}' for r in per_run)}; "
              f"median {paired:.3f} (target >= {TARGET_RATIO}) {verdict}{judged}; "
              f"ratio of the medians {of_medians:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
