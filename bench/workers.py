"""Worker throughput: what one rollq worker process sustains, and what it costs against vLLM.

Two measurements, on a redis-server this benchmark starts itself (loopback, no persistence):

fake     One worker process (``build_worker(..., burst=True)``, run in this process, logging
         configured as the CLI does and written to /dev/null) against a zero-latency fake
         vLLM: a raw asyncio HTTP/1.1 keep-alive server in a separate process that answers
         ``/v1/chat/completions`` at once with ``n`` choices of ``max_tokens`` tokens each
         (the body shape of vLLM 0.32, ``tests/fixtures/vllm/chat_completions_n2.json``:
         ``token_ids``, ``logprobs.content[]`` with ``token_id:N`` tokens and bytes, top-level
         ``prompt_token_ids``; bodies precomputed per ``(n, max_tokens)``). ``--jobs`` gsm8k
         jobs are enqueued, then the worker drains them. Wall time runs from the end of the
         worker's start-up (clients built, run registered) to the last XADD on the traj
         stream (its entry id's millisecond). Every ``--concurrency`` value is run
         ``--runs`` times, interleaved; the best median is the figure.
vllm     A real CPU vLLM server (``ops.local.stack.VllmProcess``, the tiny model of
         ``ops.local.tiny_model``) and the same ``--items`` gsm8k chat requests (``n =
         --group-size``, ``--max-tokens`` with ``ignore_eos`` so every choice has the same
         length), sent two ways at the same concurrency (``--vllm-concurrency``):
         direct  httpx + orjson straight to the server, the request body rollq sends;
                 tokens/s = generated tokens / wall from the first send to the last reply;
         rollq   enqueue the items, run one worker; tokens/s = completion tokens found in
                 the traj stream / wall (as above: start-up done to last XADD).
         Interleaved (direct, rollq, direct, rollq...), ``--vllm-runs`` each; the figure is the
         ratio of the medians rollq/direct (the median of the back-to-back pair ratios is
         printed too: it cancels slow drift). Per rollq run, "slots busy" is the share of
         concurrency x wall spent inside jobs. On a small machine the worker shares the CPU
         with vLLM, so the ratio includes what the worker's CPU takes from the server.

The vLLM interpreter comes from ``--vllm-python`` or ``ROLLQ_TEST_VLLM_PYTHON``; without one
(or with ``--skip-vllm``) the second part is skipped. Every process started here is stopped.

Run from the repository root:  python -m bench.workers  [--jobs 400 --runs 3 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from bench.common import BenchRedis, median_of, print_table, redis_cpu
from bench.fake_vllm import MODEL, FakeServerProcess, serve_fake
from rollq.producers.envs.registry import make_env
from rollq.producers.inference import SamplingParams
from rollq.producers.worker import build_worker, connect_queue, enqueue_rollout
from rollq.schemas import decode_trajectory
from rollq.schemas.keys import stream_key

ENV = "gsm8k"
TARGET_COMPLETIONS_PER_S = 1000.0
TARGET_RATIO = 0.9

# ------------------------------------------------------------------------------ a rollq run


@dataclass
class Run:
    seconds: float
    groups: int
    completions: int
    tokens: int
    worker_cpu_s: float = float("nan")
    server_cpu_s: float = float("nan")
    redis_cpu_s: float = float("nan")
    busy: float = float("nan")
    """Share of the worker's job slots (concurrency x wall) spent inside a job (group
    ``created_at`` to ``finished_at``); the rest is arq picking jobs up, acking, and idling
    until its next poll."""

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.seconds

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@contextlib.contextmanager
def _logs_discarded() -> Iterator[None]:
    """The worker's log lines (rendered as the CLI renders them) go to /dev/null."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


def _compile_cache(python: str) -> Path | None:
    """The vLLM venv's inductor cache (as the test session uses it), if there is one."""
    cache = Path(os.path.abspath(python)).parent.parent / "inductor-cache"
    return cache if cache.is_dir() else None




async def run_rollq(redis_url: str, inference_url: str, run: str, jobs: int, *,
                    group_size: int, concurrency: int, sampling: SamplingParams,
                    profile: str | None = None) -> Run:
    """Enqueue ``jobs`` gsm8k jobs of ``run``, drain them with one worker, read the stream."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.flushall()
        queue = await connect_queue(redis_url)
        try:
            await asyncio.gather(*(enqueue_rollout(queue, run, ENV, p) for p in range(jobs)))
        finally:
            await queue.aclose()
        worker: Any = build_worker(
            redis_url=redis_url, run=run, env_factory=lambda: make_env(ENV),
            inference_urls=[inference_url], model=None, sampling=sampling,
            group_size=group_size, concurrency=concurrency, job_timeout_s=300, max_tries=1,
            request_timeout_s=300, burst=True)
        marks: dict[str, float] = {}
        startup: Callable[[dict[str, Any]], Any] = worker.on_startup

        async def timed_startup(ctx: dict[str, Any]) -> None:
            await startup(ctx)
            marks["ready"] = time.time()
            marks["cpu"] = time.process_time()
            marks["redis_cpu"] = await redis_cpu(redis_url)

        worker.on_startup = timed_startup
        gc.collect()
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        with _logs_discarded():
            try:
                await worker.main()
            finally:
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(profile)
                await worker.close()
        worker_cpu = time.process_time() - marks["cpu"]
        redis_cpu_s = await redis_cpu(redis_url) - marks["redis_cpu"]
        key = stream_key(run, 0, "traj")
        entries = await client.xrange(key)
        dead = await client.xlen(stream_key(run, 0, "dead"))
        if len(entries) != jobs or dead:
            raise RuntimeError(f"{run}: {len(entries)} groups published, {dead} dead letters, "
                               f"{jobs} jobs enqueued")
        last_ms = int(entries[-1][0].split(b"-")[0])
        groups = [decode_trajectory(fields) for _, fields in entries]
        seconds = last_ms / 1000 - marks["ready"]
        in_jobs = sum(g.finished_at - g.created_at for g in groups)
        return Run(
            seconds=seconds, groups=len(groups), busy=in_jobs / (concurrency * seconds),
            completions=sum(len(g.completions) for g in groups),
            tokens=sum(g.num_tokens for g in groups),
            worker_cpu_s=worker_cpu, redis_cpu_s=redis_cpu_s,
        )
    finally:
        await client.aclose()


# ----------------------------------------------------------------------------- direct run


def chat_body(messages: list[dict[str, Any]], n: int, sampling: SamplingParams) -> bytes:
    """The request body rollq's ``InferenceServer.chat`` sends."""
    return orjson.dumps({
        **sampling.body(), "model": MODEL, "messages": messages, "n": n, "logprobs": True,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
    })


async def run_direct(url: str, bodies: list[bytes], concurrency: int) -> Run:
    """POST every body with at most ``concurrency`` in flight; count generated tokens."""
    gate = asyncio.Semaphore(concurrency)
    tokens = completions = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10, pool=None),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=None)) as client:
        async def send(body: bytes) -> None:
            nonlocal tokens, completions
            async with gate:
                response = await client.post(url + "/v1/chat/completions", content=body,
                                             headers={"content-type": "application/json"})
                response.raise_for_status()
                reply = orjson.loads(response.content)
            for choice in reply["choices"]:
                tokens += len(choice["token_ids"])
                completions += 1

        gc.collect()
        started = time.monotonic()
        cpu = time.process_time()
        await asyncio.gather(*(send(body) for body in bodies))
        seconds = time.monotonic() - started
        return Run(seconds=seconds, groups=len(bodies), completions=completions, tokens=tokens,
                   worker_cpu_s=time.process_time() - cpu)


# ---------------------------------------------------------------------------------- parts


async def bench_fake(args: argparse.Namespace, redis_url: str) -> float:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    fake = FakeServerProcess().start()
    try:
        print(f"== fake server ({fake.url}, separate process): {args.jobs} jobs x group "
              f"{args.group_size} x {args.max_tokens} tokens, concurrency "
              f"{'/'.join(map(str, concurrencies))}, {args.runs} runs each", flush=True)
        await run_rollq(redis_url, fake.url, "warm", min(args.jobs, 64),  # warm-up
                        group_size=args.group_size, concurrency=max(concurrencies),
                        sampling=sampling)
        results: dict[int, list[Run]] = {c: [] for c in concurrencies}
        for run in range(args.runs):
            for concurrency in concurrencies:
                server_cpu = fake.cpu_s()
                result = await run_rollq(redis_url, fake.url, f"fake{concurrency}r{run}",
                                         args.jobs, group_size=args.group_size,
                                         concurrency=concurrency, sampling=sampling)
                result.server_cpu_s = fake.cpu_s() - server_cpu
                results[concurrency].append(result)
                print(f"run {run + 1}/{args.runs} concurrency {concurrency:3d}: "
                      f"{result.seconds:6.3f} s  {result.completions_per_s:8.1f} completions/s  "
                      f"{result.groups_per_s:7.1f} groups/s  (cpu: worker "
                      f"{result.worker_cpu_s:.2f} s, fake server {result.server_cpu_s:.2f} s, "
                      f"redis {result.redis_cpu_s:.2f} s)", flush=True)
        if args.profile:
            best_c = max(concurrencies, key=lambda c: median_of(r.completions_per_s
                                                                  for r in results[c]))
            await run_rollq(redis_url, fake.url, "profile", args.jobs,
                            group_size=args.group_size, concurrency=best_c,
                            sampling=sampling, profile=args.profile)
            import pstats

            print(f"\ncProfile of one run at concurrency {best_c} (written to {args.profile}):")
            pstats.Stats(args.profile).sort_stats("tottime").print_stats(30)
    finally:
        fake.stop()
    print()
    rows = []
    medians = {}
    for concurrency, runs in results.items():
        medians[concurrency] = median_of(r.completions_per_s for r in runs)
        completions = runs[0].completions
        rows.append([
            f"concurrency {concurrency}",
            " ".join(f"{r.completions_per_s:.0f}" for r in runs),
            medians[concurrency],
            median_of(r.groups_per_s for r in runs),
            f"{median_of(r.worker_cpu_s / completions * 1e6 for r in runs):.0f}",
            f"{median_of(r.server_cpu_s / completions * 1e6 for r in runs):.0f}",
            f"{median_of(r.redis_cpu_s / completions * 1e6 for r in runs):.0f}",
        ])
    print_table(["fake server", "completions/s per run", "median completions/s",
                 "median groups/s", "worker CPU us/compl", "server CPU us/compl",
                 "redis CPU us/compl"], rows,
                title=f"one worker process vs a zero-latency fake, {args.jobs} groups of "
                      f"{args.group_size} x {args.max_tokens} tokens per run, "
                      f"median of {args.runs}")
    best = max(medians, key=lambda c: medians[c])
    return medians[best]


async def bench_vllm(args: argparse.Namespace, redis_url: str, python: str) -> float:
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                              extra={"ignore_eos": True})
    env = make_env(ENV)
    bodies = [chat_body(env.prompt(env.item(p % len(env))), args.group_size, sampling)  # type: ignore[arg-type]
              for p in range(args.items)]
    with tempfile.TemporaryDirectory(prefix="rollq-bench-vllm-") as tmp:
        from rollq.ops.local.stack import VllmProcess
        from rollq.ops.local.tiny_model import write_tiny_model

        with _logs_discarded():  # transformers' progress bar
            model_dir = write_tiny_model(Path(tmp) / MODEL, seed=0)
        vllm = VllmProcess(python, model_dir, Path(tmp) / "vllm.log",
                           compile_cache=_compile_cache(python))
        started = time.monotonic()
        print("== real vLLM: starting the CPU server with the tiny model ...", flush=True)
        vllm.start()
        try:
            print(f"vLLM ready on {vllm.url} after {time.monotonic() - started:.0f} s; "
                  f"{args.items} gsm8k items x n={args.group_size} x {args.max_tokens} tokens "
                  f"(ignore_eos), concurrency {args.vllm_concurrency}, {args.vllm_runs} runs each",
                  flush=True)
            # warm-up: one full untimed pass of each (the server's first batches are slow)
            await run_direct(vllm.url, bodies, args.vllm_concurrency)
            await run_rollq(redis_url, vllm.url, "vwarm", args.items, group_size=args.group_size,
                            concurrency=args.vllm_concurrency, sampling=sampling)
            results: dict[str, list[Run]] = {"direct": [], "rollq": []}
            for run in range(args.vllm_runs):
                for name in ("direct", "rollq"):
                    if name == "direct":
                        result = await run_direct(vllm.url, bodies, args.vllm_concurrency)
                    else:
                        result = await run_rollq(
                            redis_url, vllm.url, f"vllm{run}", args.items,
                            group_size=args.group_size, concurrency=args.vllm_concurrency,
                            sampling=sampling)
                    results[name].append(result)
                    print(f"run {run + 1}/{args.vllm_runs} {name:6s}: {result.seconds:6.3f} s  "
                          f"{result.tokens:,} tokens  {result.tokens_per_s:8.1f} tokens/s  "
                          f"(client/worker cpu {result.worker_cpu_s:.2f} s"
                          + ("" if name == "direct" else f", slots busy {result.busy:.0%}")
                          + ")", flush=True)
        finally:
            vllm.stop()
    print()
    medians = {name: median_of(r.tokens_per_s for r in runs) for name, runs in results.items()}
    print_table(
        ["real vLLM", "tokens/s per run", "median tokens/s", "median s/run",
         "client/worker CPU s"],
        [[name, " ".join(f"{r.tokens_per_s:.0f}" for r in runs), medians[name],
          f"{median_of(r.seconds for r in runs):.3f}",
          f"{median_of(r.worker_cpu_s for r in runs):.2f}"]
         for name, runs in results.items()],
        title=f"same {args.items} requests direct vs through rollq, median of {args.vllm_runs}")
    paired = [r.tokens_per_s / d.tokens_per_s
              for d, r in zip(results["direct"], results["rollq"], strict=True)]
    print(f"per-pair rollq/direct: {' '.join(f'{x:.2f}' for x in paired)} "
          f"(median {median_of(paired):.2f}; pairs ran back to back, so drift cancels)\n")
    return medians["rollq"] / medians["direct"]


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=400,
                        help="groups per fake-server run (default 400)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (8)")
    parser.add_argument("--concurrency", default="8,32,64",
                        help="worker concurrencies tried against the fake, comma-separated "
                             "(default 8,32,64)")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs per concurrency against the fake (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens per completion, both parts (default 64)")
    parser.add_argument("--items", type=int, default=48,
                        help="gsm8k items (groups) per real-vLLM run (default 48)")
    parser.add_argument("--vllm-runs", type=int, default=5,
                        help="runs per variant against real vLLM (default 5; a run is short "
                             "and the server's speed drifts)")
    parser.add_argument("--vllm-concurrency", type=int, default=8,
                        help="requests in flight, direct and rollq, real vLLM (default 8)")
    parser.add_argument("--skip-vllm", action="store_true", help="fake-server part only")
    parser.add_argument("--skip-fake", action="store_true", help="real-vLLM part only")
    parser.add_argument("--vllm-python", default=os.environ.get("ROLLQ_TEST_VLLM_PYTHON"),
                        help="python of a venv with vLLM [ROLLQ_TEST_VLLM_PYTHON]")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="worker log level; logs are rendered as JSON and discarded")
    parser.add_argument("--profile", metavar="FILE",
                        help="cProfile one extra fake-server run at the best concurrency")
    parser.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    from rollq.ops.logging import configure_logging

    configure_logging("json", args.log_level)  # as `rollq workers` does (stderr: /dev/null)
    fake_rate: float | None = None
    ratio: float | None = None
    with BenchRedis() as redis:
        print(f"redis-server {redis.version()} on 127.0.0.1:{redis.port} (no persistence); "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs\n", flush=True)
        if not args.skip_fake:
            fake_rate = await bench_fake(args, redis.url)
        if args.skip_vllm:
            pass
        elif not args.vllm_python:
            print("real vLLM: skipped (give --vllm-python or set ROLLQ_TEST_VLLM_PYTHON)\n")
        else:
            ratio = await bench_vllm(args, redis.url, args.vllm_python)
    if fake_rate is not None:
        verdict = "OK" if fake_rate >= TARGET_COMPLETIONS_PER_S else "BELOW TARGET"
        print(f"fake server: {fake_rate:.0f} completions/s "
              f"(target >= {TARGET_COMPLETIONS_PER_S:.0f}) {verdict}")
    if ratio is not None:
        verdict = "OK" if ratio >= TARGET_RATIO else "BELOW TARGET"
        print(f"real vLLM: rollq/direct tokens/s ratio {ratio:.2f} (target >= {TARGET_RATIO}) "
              f"{verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_fake is not None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_fake(args.serve_fake))
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
