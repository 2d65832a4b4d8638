"""Scorer throughput: groups/s of ONE scorer process through the real consumer path.

On a redis-server this benchmark starts itself (loopback, persistence off), per run:
``G`` trajectory groups (default 200 x 16 completions of GSM8K/MATH-like text: a
``<think>`` block of step-by-step reasoning with numbers and LaTeX, then a ``\\boxed{}``
answer, right or wrong, 1-3 KB each; the gold answer in ``metadata["answer"]``) are
XADDed to the traj stream before the clock starts, then one scorer, wired exactly as
``ops.roles.run_scorer`` wires it (``StreamReader`` in group ``scorers`` with
``count=concurrency``, ``Scorer(bridge, fingerprint, redis)`` in a ``Stage`` with the same
concurrency) runs its burst path (``Stage.drain``) until every group is forwarded or
dropped. The clock covers only the drain: the bridge (and its process pool, whose start-up
is reported apart) is opened once per config, before the first run.

Configs (zero-variance policy ``keep`` in both, so no group is dropped):

(a) ``format`` (preset ``think``) + ``length_bounty``: inline components only;
(b) ``preset: r1``: ``accuracy`` (math-verify, in the process pool) + ``format`` (preset
    ``r1``) + ``tag_count``.

During every run a ticker task on the same event loop sleeps 10 ms over and over and records
how late it wakes up (actual - expected): the event-loop lag, p50/p99/max.

``--tokens N`` gives every completion N token ids and logprobs (default: a quarter of its
text's length in bytes, ~500), with the same texts: the scorer reads the token arrays with
each entry but no component here uses them, so ``--tokens 2048`` against ``--tokens 64``
is what the arrays alone cost a scorer (its CPU, and Redis's CPU per group, reported too).

Also reported: the mean ms per group each component spent (``GroupScore.timings``: the wall
time of the one scoring call a read's groups share, divided among them; a pooled component's
figure includes waiting for a free worker), and each component's serial in-process CPU cost
per group (the work itself).

Run from the repository root:  python -m bench.scorer  [--groups 200 --runs 3 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import yaml

from bench.common import BenchRedis, median_of, print_table, redis_cpu
from bench.rollouts import make_completion_text, make_problem
from rollq.consumers.bus import StreamReader
from rollq.consumers.scorer.bridge import GroupScore, RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.scorer.errors import ScoringError
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.stage import Stage
from rollq.ops.logging import configure_logging
from rollq.ops.roles import consumer_name, load_reward_config
from rollq.ops.settings import ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import Completion, Fields, TrajectoryGroup, encode
from rollq.schemas.keys import stream_keys

RUN = "benchscorer"
TICK_S = 0.010

CONFIGS: dict[str, dict[str, Any]] = {
    "a: format+length": {
        "components": [
            {"name": "format", "component": "format", "settings": {"preset": "think"}},
            {"name": "length_bounty", "component": "length_bounty"},
        ],
        "advantages": {"zero_variance": "keep"},
    },
    "b: r1 (math-verify)": {
        "preset": "r1",
        "advantages": {"zero_variance": "keep"},
    },
}

# ----------------------------------------------------------------------------- groups


def make_group(rng: np.random.Generator, group_size: int, run: str = RUN,
               tokens: int = 0) -> TrajectoryGroup:
    """A group of ``group_size`` completions to one problem, ~half of them correct;
    ``tokens`` token ids per completion (0: a quarter of the text's length, at least 16)."""
    problem = make_problem(rng)
    completions = []
    for _ in range(group_size):
        text, finish = make_completion_text(rng, problem, bool(rng.random() < 0.5))
        n = tokens or max(16, len(text) // 4)
        completions.append(Completion(
            completion_ids=rng.integers(0, 150_000, n, dtype=np.int32),
            logprobs=-rng.random(n, dtype=np.float32) * 2,
            loss_mask=np.ones(n, np.uint8),
            policy_version=0,
            finish_reason=finish,
            text=text,
        ))
    now = time.time()
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex, run=run, env="math", policy_version=0,
        prompt_ids=rng.integers(0, 150_000, max(16, len(problem.prompt) // 4), dtype=np.int32),
        prompt_text=problem.prompt, completions=tuple(completions),
        metadata={"answer": problem.gold}, created_at=now, finished_at=now,
    )


def make_groups(count: int, group_size: int, seed: int = 0,
                tokens: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    return [make_group(rng, group_size, tokens=tokens) for _ in range(count)]


# --------------------------------------------------------------------------- measure


class TimedBridge(RewardBridge):
    """A ``RewardBridge`` that keeps every group's share of ``GroupScore.timings``."""

    def __init__(self, config: RewardConfig) -> None:
        super().__init__(config)
        self.timings: list[dict[str, float]] = []

    async def score_groups(
        self, groups: Sequence[Sequence[Sample]]
    ) -> list[GroupScore | ScoringError]:
        # Every path scores through here: the Scorer scores each read as one call, and a
        # GroupScore's timings are the whole call's, so each group gets its share.
        results = await super().score_groups(groups)
        scored = [r for r in results if isinstance(r, GroupScore)]
        self.timings.extend({name: seconds / len(scored) for name, seconds in r.timings.items()}
                            for r in scored)
        return results


async def ticker(stop: asyncio.Event, lags: list[float]) -> None:
    """Sleep ``TICK_S`` over and over on this loop; record how late each wake-up is (s)."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - started - TICK_S)


def pool_cpu_s(bridge: RewardBridge) -> float:
    """CPU seconds (user + sys) the bridge's live pool workers used so far; Linux /proc only
    (NaN elsewhere or without a pool). Reads the pool's private worker list: bench-only."""
    pool = bridge._pool
    if pool is None:
        return 0.0
    total = 0.0
    try:
        for worker in list(pool._workers):
            with open(f"/proc/{worker.process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError, AttributeError):
        return float("nan")
    return total / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


@dataclass
class Run:
    seconds: float
    groups: int
    forwarded: int
    dropped: int
    lags_ms: list[float]
    timings: list[dict[str, float]]
    cpu_s: float
    pool_cpu_s: float
    mean_reward: float = 0.0
    redis_cpu_s: float = 0.0

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


async def publish_all(url: str, payloads: list[Fields]) -> None:
    """Fresh database; the run registered; every payload XADDed to the traj stream."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        publisher = Publisher(client, RUN)
        await publisher.register()
        key = stream_keys(RUN, publisher.partitions, "traj")[0]
        for start in range(0, len(payloads), 50):
            pipe = client.pipeline(transaction=False)
            for fields in payloads[start:start + 50]:
                pipe.xadd(key, fields)
            await pipe.execute()
    finally:
        await client.aclose()


async def mean_reward(client: aioredis.Redis) -> float:
    """Mean of the rewards in the scored stream (a sanity check that scoring happened)."""
    key = stream_keys(RUN, 1, "scored")[0]
    entries = await client.xrange(key)
    rewards = [np.frombuffer(f[b"rewards"], np.float32) for _, f in entries]
    return float(np.concatenate(rewards).mean()) if rewards else float("nan")


async def scorer_run(settings: ScorerSettings, bridge: TimedBridge, config: RewardConfig,
                     client: aioredis.Redis, groups: int) -> Run:
    """One burst drain of the traj stream by a scorer wired as ``run_scorer`` wires it."""
    reader = StreamReader(client, stream_keys(RUN, 1, "traj"), "scorers",
                          consumer_name(settings, "scorer"),
                          settings.reader_settings(settings.concurrency))
    stage = Stage(reader, Scorer(bridge, config_fingerprint(config), client),
                  concurrency=settings.concurrency)
    await reader.ensure_groups()
    bridge.timings.clear()
    lags: list[float] = []
    stop = asyncio.Event()
    gc.collect()
    tick = asyncio.create_task(ticker(stop, lags))
    await asyncio.sleep(0)
    redis_before = await redis_cpu(settings.redis_url)
    cpu, pool_cpu = time.process_time(), pool_cpu_s(bridge)
    started = time.perf_counter()
    await stage.drain()
    seconds = time.perf_counter() - started
    cpu_s, pool_cpu = time.process_time() - cpu, pool_cpu_s(bridge) - pool_cpu
    redis_s = await redis_cpu(settings.redis_url) - redis_before
    stop.set()
    await tick
    if stage.forwarded + stage.dropped != groups or stage.dead_lettered:
        raise RuntimeError(f"scorer handled {stage.forwarded} forwarded + {stage.dropped} "
                           f"dropped + {stage.dead_lettered} dead of {groups} groups")
    return Run(seconds, groups, stage.forwarded, stage.dropped, [x * 1e3 for x in lags],
               list(bridge.timings), cpu_s, pool_cpu, await mean_reward(client), redis_s)


class _DeprecationNoise(logging.Filter):
    # what the pool workers filter too: math-verify warns on every call with equations=True
    def filter(self, record: logging.LogRecord) -> bool:
        return "is deprecated" not in record.getMessage()


def serial_costs(config: RewardConfig, groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Each component's CPU ms per group, evaluated serially in this process."""
    logging.getLogger("latex2sympy2_extended.math_normalization").addFilter(_DeprecationNoise())
    bridge = RewardBridge(config)
    out: dict[str, float] = {}
    samples = [[bridge.make_sample(c.text, c.completion_ids, finish_reason=c.finish_reason,
                                   metadata=g.metadata, prompt=g.prompt_text)
                for c in g.completions] for g in groups]
    for entry in config.components:
        component = entry.build()
        component.evaluate(samples[0][0], samples[0])  # imports, regex compile
        started = time.process_time()
        for group in samples:
            for sample in group:
                component.evaluate(sample, group)
        out[entry.name] = (time.process_time() - started) / len(groups) * 1e3
    return out


async def idle_lag(seconds: float = 1.0) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(ticker(stop, lags))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return [x * 1e3 for x in lags]


# ------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scorer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=200, help="groups per run (default 200)")
    parser.add_argument("--runs", type=int, default=3, help="runs per config (default 3)")
    parser.add_argument("--group-size", type=int, default=16, help="completions per group")
    parser.add_argument("--tokens", type=int, default=0,
                        help="token ids per completion, same texts (default 0: a quarter of "
                             "the text's length in bytes); 2048 against 64 is what the "
                             "token arrays cost a scorer")
    parser.add_argument("--concurrency", type=int, default=ScorerSettings().concurrency,
                        help="scorer concurrency = read count (default: ScorerSettings')")
    parser.add_argument("--processes", type=int, default=ScorerSettings().processes,
                        help="reward pool workers (default: ScorerSettings')")
    parser.add_argument("--only", choices=["a", "b"], help="run one config only")
    parser.add_argument("--profile", metavar="FILE",
                        help="cProfile one extra run of each config, stats to FILE.<a|b>")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    print(f"building {args.groups} groups of {args.group_size} completions per run ...",
          flush=True)
    # fresh groups (new seed) for every run, so no cache in the scorer or its workers
    # (sympy, math-verify) sees a text twice; sets[0] warms up and feeds the serial costs
    sets = [make_groups(args.groups, args.group_size, seed, args.tokens)
            for seed in range(args.runs + 1)]
    encoded = [[encode(g) for g in groups] for groups in sets]
    groups, payloads = sets[0], encoded[0]
    texts = [len(c.text.encode()) for g in groups for c in g.completions]
    tokens = [len(c.completion_ids) for g in groups for c in g.completions]
    configs = {k: v for k, v in CONFIGS.items() if args.only is None or k.startswith(args.only)}

    results: dict[str, list[Run]] = {}
    startup: dict[str, float] = {}
    serial: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rollq-bench-scorer-") as tmp, BenchRedis() as server:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"redis-server {server.version()} on 127.0.0.1:{server.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; load average {load}")
        print(f"text per completion: median {median_of(texts):,.0f} B "
              f"(min {min(texts):,}, max {max(texts):,}); completion tokens median "
              f"{median_of(tokens):,.0f}; concurrency {args.concurrency}, pool workers "
              f"{args.processes}\n", flush=True)
        client = aioredis.Redis.from_url(server.url)
        try:
            base_lag = await idle_lag()
            for name, document in configs.items():
                path = Path(tmp) / f"reward-{name[0]}.yaml"
                path.write_text(yaml.safe_dump(document))
                settings = ScorerSettings(redis_url=server.url, run=RUN, reward_config=path,
                                          concurrency=args.concurrency,
                                          processes=args.processes)
                config = load_reward_config(path, processes=settings.processes)
                serial[name] = serial_costs(config, groups[:24])
                opened = time.perf_counter()
                bridge = TimedBridge(config)
                async with bridge:
                    startup[name] = time.perf_counter() - opened
                    warm = min(len(payloads), 2 * args.concurrency)
                    await publish_all(server.url, payloads[:warm])
                    await scorer_run(settings, bridge, config, client, warm)
                    results[name] = []
                    for run in range(args.runs):
                        await publish_all(server.url, encoded[run + 1])
                        result = await scorer_run(settings, bridge, config, client,
                                                  len(encoded[run + 1]))
                        results[name].append(result)
                        print(f"{name:22s} run {run + 1}/{args.runs}: {result.seconds:6.2f} s "
                              f"{result.groups_per_s:7.1f} groups/s  loop lag p99 "
                              f"{percentile(result.lags_ms, 99):6.1f} ms  cpu(main) "
                              f"{result.cpu_s:5.2f} s  cpu(pool) {result.pool_cpu_s:5.2f} s  "
                              f"mean reward {result.mean_reward:.3f}",
                              flush=True)
                    if args.profile:
                        import cProfile
                        import pstats

                        await publish_all(server.url, payloads)
                        # CPU time, not wall: robust to a busy host
                        profiler = cProfile.Profile(time.process_time)
                        profiler.enable()
                        await scorer_run(settings, bridge, config, client, len(payloads))
                        profiler.disable()
                        profiler.dump_stats(f"{args.profile}.{name[0]}")
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        finally:
            await client.aclose()
    print()

    rows = []
    for name, runs in results.items():
        rows.append([
            name,
            " ".join(f"{r.groups_per_s:.1f}" for r in runs),
            median_of(r.groups_per_s for r in runs),
            median_of(r.groups_per_s * args.group_size for r in runs),
            f"{median_of(r.cpu_s / r.groups * 1e3 for r in runs):.3f}",
            f"{median_of(r.pool_cpu_s / r.groups * 1e3 for r in runs):.3f}",
            f"{median_of(r.redis_cpu_s / r.groups * 1e3 for r in runs):.3f}",
            median_of(percentile(r.lags_ms, 50) for r in runs),
            median_of(percentile(r.lags_ms, 99) for r in runs),
            median_of(max(r.lags_ms) for r in runs),
            startup[name],
        ])
    rows.append(["(idle loop, for reference)", "", "", "", "", "", "", percentile(base_lag, 50),
                 percentile(base_lag, 99), max(base_lag), ""])
    print_table(["config", "groups/s per run", "median groups/s", "completions/s",
                 "main CPU ms/group", "pool CPU ms/group", "redis CPU ms/group", "lag p50 ms",
                 "lag p99 ms", "lag max ms", "bridge start s"], rows,
                title=f"one scorer process, {args.groups} groups x {args.group_size} per run, "
                      f"median of {args.runs} runs (lag: 10 ms ticker on the scorer's loop)")

    comp_rows = []
    for name, runs in results.items():
        for component in serial[name]:
            wall = median_of(float(np.mean([t[component] for t in r.timings])) * 1e3
                             for r in runs)
            comp_rows.append([name, component, f"{wall:.3f}", f"{serial[name][component]:.3f}",
                              f"{serial[name][component] / args.group_size:.4f}"])
    print_table(["config", "component", "wall ms/group in scorer", "serial CPU ms/group",
                 "serial CPU ms/completion"], comp_rows,
                title="per component: GroupScore.timings (wall, each read's scoring call "
                      "shared among its groups) and serial in-process CPU cost")

    for name, runs in results.items():
        gps = median_of(r.groups_per_s for r in runs)
        lag99 = median_of(percentile(r.lags_ms, 99) for r in runs)
        print(f"{name}: {gps:.1f} groups/s ({gps * args.group_size:.0f} completions/s) per "
              f"scorer process; event-loop lag p99 {lag99:.1f} ms")
    pooled = [n for n in serial.get("b: r1 (math-verify)", {}) if n == "accuracy"]
    if pooled:
        cost = serial["b: r1 (math-verify)"]["accuracy"]
        print(f"math-verify costs {cost:.1f} CPU ms per group serially: {args.processes} "
              f"workers cap (b) near {args.processes * 1e3 / cost:.1f} groups/s on "
              f"{args.processes} free cores ({os.cpu_count()} CPUs here, shared with the "
              "scorer's loop and redis-server)")
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging("json", "warning")  # as a deployed scorer, minus info lines
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
