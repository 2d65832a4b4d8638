"""Soak: the whole pipeline for a long time; does anything grow?

    python -m bench.soak --minutes 30          # the full soak (~32 min)
    python -m bench.soak --short               # 90 s, as .ci/test runs it

The pipeline of ``bench.pipeline`` (real redis-server, zero-latency fake vLLM, feed, two
workers, two scorers, the SDK trainer acking) runs for ``--minutes``; every
``--restart-every-s`` one role (a worker, a scorer or the trainer, in turn) is stopped with
SIGTERM and started again, under a new consumer name, as a deploy would. Every
``--sample-every-s`` the script samples Redis ``used_memory``, key counts by kind, stream
lengths, the trainer's seen-set, each role's RSS (its whole process group), the event-loop
lag the roles log, and groups/s.

Every bounded structure is set to plateau early (retention, job results, consumer idle time
60 s; the trainer's dedup window 240 s): what is judged is that nothing grows once those
windows are full. At the end it fits a line to each series over the last two thirds of the
run and prints the slope per hour next to the threshold it is judged by: a series is *flat* when its
fitted growth over that window is at most ``max(abs_floor, 5 % of its mean)`` (a series
that falls, as a restarted role's RSS does, is not a leak). It writes
``soak.csv`` and ``soak.png`` to ``--out``, checks that no group was lost or duplicated,
prints ``soak: <verdict> ...`` and exits 1 unless everything is flat and nothing was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import itertools
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from bench.fake_vllm import FakeServerProcess
from bench.pipeline import RUN, PipelineOptions, Role, build_roles, outcome
from rollq.ops.local.stack import RedisProcess
from rollq.schemas.keys import CONSUMED_COUNTER, counters_key, run_key, stream_key

# What "flat" means per kind of series: the absolute change over the judged window that is
# noise whatever the mean (allocator pages, a batch in flight), and the relative one.
ABSOLUTE_FLOOR = {"redis_used_mb": 2.0, "rss_mb": 8.0, "keys": 20.0, "entries": 400.0,
                  "lag_ms": 20.0}
RELATIVE = 0.05
REPORTED_ONLY = ("lag_ms",)
"""Series shown but not judged: a role's p99 loop lag follows whatever else the machine
runs (it is no state that accumulates); it is printed with its trend, the verdict is on
memory, keys, stream lengths and RSS."""
SHORT_REPORTED_ONLY = (*REPORTED_ONLY, "rss_mb", "keys[total]")
"""``--short`` also reports RSS without judging it: in 90 s every role restarts once, and a
process restarted inside the judged window is still warming up (a CI run beside other jobs
saw two restarted roles' RSS rise 13.6 MB in their first minute, lost 0, duplicated 0).
Nor the total key count: each kind of key is judged on its own, and their sum adds up
their noise over a 0.9-minute window (a CI run on a loaded machine: arq's job, result,
retry and in-progress keys each moved 3-11, every one flat, the total 25.5 over its floor
of 20). RSS and the total are judged by the full soak (30 minutes, docs/benchmarks.md);
the short one judges the state that could accumulate: Redis memory, each kind of key,
stream lengths, the seen-set."""


@dataclass
class Series:
    name: str
    kind: str
    values: list[float]


def _group_rss_mb(pgid: int) -> float:
    """RSS of every process in process group ``pgid`` (a role and its pool children)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # field 5 of stat: the process group
                continue
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e6


def _last_lag_ms(log: Path) -> float | None:
    """p99 of the last ``event_loop_lag`` line a role logged (None before the first)."""
    try:
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - 200_000))
            tail = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        if '"event_loop_lag"' in line:
            with contextlib.suppress(ValueError, KeyError):
                return float(json.loads(line)["p99_ms"])
    return None


async def _key_counts(redis: aioredis.Redis) -> Counter[str]:
    counts: Counter[str] = Counter()
    async for key in redis.scan_iter(count=1000):
        name = key.decode(errors="replace")
        if name.startswith("arq:"):
            counts[":".join(name.split(":")[:2])] += 1  # arq:job, arq:result, ...
        elif name.startswith("rollq:"):  # rollq:traj, rollq:trainer:seen:*, ...
            tail = name.split("}:", 1)[-1]
            counts["rollq:" + re.sub(r"\d+", "*", tail)] += 1
        else:
            counts["other"] += 1
    return counts


async def sample(redis: aioredis.Redis, roles: list[Role],
                 warming: set[str] = frozenset()) -> dict[str, float]:  # type: ignore[assignment]
    """One row of samples; roles in ``warming`` (just restarted) give no RSS or lag yet."""
    info = await redis.info("memory")
    row: dict[str, float] = {"t": time.time(), "redis_used_mb": info["used_memory"] / 1e6}
    for kind, count in (await _key_counts(redis)).items():
        row[f"keys[{kind}]"] = count
    row["keys[total]"] = int(await redis.dbsize())
    for name in ("traj", "scored", "dead"):
        row[f"entries[{name}]"] = int(await redis.xlen(stream_key(RUN, 0, name)))
    row["entries[seen]"] = sum([int(await redis.hlen(key)) for key in
                                await redis.keys(run_key(RUN, "trainer:seen:*"))])
    for stream in ("traj", "scored"):
        with contextlib.suppress(aioredis.ResponseError):
            groups = await redis.xinfo_groups(stream_key(RUN, 0, stream))
            row[f"keys[consumers:{stream}]"] = sum(int(g["consumers"]) for g in groups)
    row["consumed"] = int(await redis.hget(counters_key(RUN, 0), CONSUMED_COUNTER) or 0)
    for role in roles:
        if role.name in warming:
            continue
        if role.process is not None:
            row[f"rss_mb[{role.name}]"] = _group_rss_mb(role.process.pid)
        lag = _last_lag_ms(role.log)
        if lag is not None:
            row[f"lag_ms[{role.name}]"] = lag
    return row


def judge(rows: list[dict[str, float]], judged_from: float) -> list[tuple[str, float, float,
                                                                          float, bool]]:
    """(series, slope per hour, change over the window, threshold, flat) per series."""
    window = [r for r in rows if r["t"] >= judged_from]
    verdicts = []
    names = sorted({k for r in window for k in r if k not in ("t", "consumed")})
    for name in names:
        points = [(r["t"], r[name]) for r in window if name in r]
        if len(points) < 3:
            continue
        t, v = np.array(points).T
        slope = float(np.polyfit(t - t[0], v, 1)[0])  # per second
        change = slope * (t[-1] - t[0])
        kind = name.split("[")[0]
        threshold = max(ABSOLUTE_FLOOR.get(kind, 1.0), RELATIVE * abs(float(np.mean(v))))
        # Growth is the failure; a series that falls (a role restarted) is not a leak.
        verdicts.append((name, slope * 3600, change, threshold, change <= threshold))
    return verdicts


def rates(rows: list[dict[str, float]]) -> list[float]:
    """groups/s between consecutive samples."""
    return [(b["consumed"] - a["consumed"]) / max(1e-9, b["t"] - a["t"])
            for a, b in itertools.pairwise(rows)]


def plot(rows: list[dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib missing (the 'train' extra): no plot", file=sys.stderr)
        return
    t0 = rows[0]["t"]
    minutes = [(r["t"] - t0) / 60 for r in rows]
    panels = [("redis_used_mb", "Redis used memory (MB)"), ("rss_mb", "role RSS (MB)"),
              ("keys", "keys"), ("entries", "stream entries / seen-set"),
              ("lag_ms", "event-loop lag p99 (ms)")]
    figure, axes = plt.subplots(len(panels) + 1, 1, figsize=(10, 3 * (len(panels) + 1)),
                                sharex=True)
    for axis, (prefix, title) in zip(axes, panels, strict=False):
        for name in sorted({k for r in rows for k in r if k.startswith(prefix)}):
            axis.plot(minutes, [r.get(name, np.nan) for r in rows], label=name)
        axis.set_title(title)
        axis.legend(fontsize=6, ncol=3)
    axes[-1].plot(minutes[1:], rates(rows))
    axes[-1].set_title("groups/s consumed")
    axes[-1].set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(path, dpi=80)


async def soak(args: argparse.Namespace, out: Path) -> int:
    redis_server = RedisProcess(out / "redis", appendonly=True, appendfsync="everysec").start()
    fake = FakeServerProcess().start()
    options = PipelineOptions(groups=10**7, batch_groups=8, step_s=args.step_s,
                              fixed_consumer_names=False,
                              retention_s=args.retention_s,
                              dedup_window_s=args.dedup_window_s)
    roles = build_roles(redis_server.url, fake.url, out, options)
    redis = aioredis.Redis.from_url(redis_server.url)
    rows: list[dict[str, float]] = []
    started = time.monotonic()
    deadline = started + args.minutes * 60
    restartable = itertools.cycle([r for r in roles if r.name != "feeder"])
    next_restart = started + args.restart_every_s
    next_sample = started + args.sample_every_s
    last_start = {role.name: started for role in roles}
    try:
        for role in roles:
            role.start()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if now >= next_restart:
                role = next(restartable)
                print(f"[{(now - started) / 60:5.1f} min] restarting {role.name}", flush=True)
                await asyncio.to_thread(role.stop)
                role.start()
                last_start[role.name] = time.monotonic()
                next_restart = now + args.restart_every_s
            if now >= next_sample:
                warming = {name for name, at in last_start.items()
                           if now - at < args.warmup_s}
                rows.append(await sample(redis, roles, warming))
                next_sample = now + args.sample_every_s
                last = rows[-1]
                recent = rates(rows[-2:]) if len(rows) > 1 else [0.0]
                print(f"[{(now - started) / 60:5.1f} min] redis {last['redis_used_mb']:.1f} MB, "
                      f"{int(last['keys[total]'])} keys, {recent[-1]:.1f} groups/s", flush=True)
        # Drain: stop admitting, let what is in flight reach the trainer.
        feeder = roles[0]
        await asyncio.to_thread(feeder.stop)
        for _ in range(120):
            await asyncio.sleep(1.0)
            if await _drained(redis):
                break
        await asyncio.sleep(2.0)
        result = await outcome(redis, RUN, out / "trainer.json", started)
    finally:
        for role in roles:
            role.stop()
        await redis.aclose()
        fake.stop()
        redis_server.stop()
    judged_from = rows[0]["t"] + (rows[-1]["t"] - rows[0]["t"]) / 3 if rows else 0.0
    return report(rows, result, out, judged_from=judged_from,
                  reported_only=SHORT_REPORTED_ONLY if args.short else REPORTED_ONLY)


async def _drained(redis: aioredis.Redis) -> bool:
    """No job queued, nothing unread or pending on either stream."""
    if int(await redis.zcard(run_key(RUN, "jobs"))):
        return False
    for name in ("traj", "scored"):
        for group in await redis.xinfo_groups(stream_key(RUN, 0, name)):
            if group["pending"] or group.get("lag"):
                return False
    return True


def report(rows: list[dict[str, float]], result: object, out: Path, *,
           judged_from: float, reported_only: tuple[str, ...] = REPORTED_ONLY) -> int:
    from bench.pipeline import Outcome

    assert isinstance(result, Outcome)
    with (out / "soak.csv").open("w", newline="") as handle:
        names = sorted({k for r in rows for k in r})
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "soak.png")
    verdicts = judge(rows, judged_from)
    print(f"\n{'series':<34} {'slope/h':>10} {'change':>10} {'threshold':>10}  verdict")
    for name, per_hour, change, threshold, flat in verdicts:
        judged = not name.startswith(reported_only)
        verdict = ("flat" if flat else "GROWS") if judged else "(reported)"
        print(f"{name:<34} {per_hour:>10.2f} {change:>10.2f} {threshold:>10.2f}  {verdict}")
    throughput = rates(rows)
    steady = throughput[len(throughput) // 3:]
    growing = [name for name, _, _, _, flat in verdicts
               if not flat and not name.startswith(reported_only)]
    verdicts = [v for v in verdicts if not v[0].startswith(reported_only)]
    print(f"groups/s over the judged window: median {np.median(steady):.1f}, "
          f"p10 {np.percentile(steady, 10):.1f}, p90 {np.percentile(steady, 90):.1f}"
          if steady else "groups/s: too few samples")
    print(result.line("soak"))
    ok = not growing and result.ok and bool(steady)
    print(f"soak: {'FLAT' if ok else 'NOT FLAT'} over the last "
          f"{(rows[-1]['t'] - judged_from) / 60:.1f} min "
          f"({len(verdicts) - len(growing)}/{len(verdicts)} series flat"
          f"{'; growing: ' + ', '.join(growing) if growing else ''}); "
          f"lost {len(result.lost)}, duplicated {len(result.duplicated)}; "
          f"csv and plot in {out}", flush=True)
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--short", action="store_true",
                        help="90 s, samples every 5 s, a restart every 20 s, RSS reported "
                        "but not judged (CI)")
    parser.add_argument("--sample-every-s", type=float, default=30.0)
    parser.add_argument("--restart-every-s", type=float, default=180.0)
    parser.add_argument("--step-s", type=float, default=0.5,
                        help="seconds per trainer step: paces the run (8 groups a step) "
                        "[0.5: 16 groups/s, below what a loaded 2-core machine sustains, "
                        "so that state measures leaks, not a backlog that grows whenever "
                        "the machine falls behind the pace]")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="a (re)started role's RSS and lag are not sampled this long: "
                        "imports and caches fill up [60]")
    parser.add_argument("--retention-s", type=float, default=60.0,
                        help="the roles' retention_s: acked entries kept this long [60]")
    parser.add_argument("--dedup-window-s", type=float, default=240.0,
                        help="the trainer's dedup_window_s: its seen-set plateaus after it "
                        "[240]")
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args(argv)
    if args.short:
        args.minutes, args.sample_every_s, args.restart_every_s = 1.5, 5.0, 20.0
        args.warmup_s = min(args.warmup_s, 20.0)
        args.retention_s = min(args.retention_s, 15.0)
        args.dedup_window_s = min(args.dedup_window_s, 20.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(soak(args, args.out))


if __name__ == "__main__":
    sys.exit(main())
