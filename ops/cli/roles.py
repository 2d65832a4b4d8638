"""``rollq workers | feed | score | rescore``: the long-running roles and the replay. Every
flag but a command's own switches (``--burst``) is a setting (``ops.cli.common``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from rollq.ops.cli.common import (
    ONE_SHOT,
    Exit,
    add_settings_flags,
    not_found,
    redis_client,
    settings_for,
)
from rollq.ops.lifecycle import stop_on_signals
from rollq.ops.settings import FeederSettings, ScorerSettings, WorkerSettings
from rollq.schemas.runs import known_runs


def workers_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, WorkerSettings)
    parser.add_argument("--burst", action="store_true", help="exit once the queue is empty")


async def workers(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.roles import run_workers  # the roles' wiring imports arq and the envs

    settings = settings_for(WorkerSettings, args, environ)
    await run_workers(settings, burst=args.burst)
    return Exit.OK


def feed_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, FeederSettings)


async def feed(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.roles import run_feeder

    settings = settings_for(FeederSettings, args, environ)
    await run_feeder(settings, stop_on_signals())
    return Exit.OK


def score_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, ScorerSettings)
    parser.add_argument("--burst", action="store_true",
                        help="score what is there now, then exit")


async def score(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.roles import run_scorer

    settings = settings_for(ScorerSettings, args, environ)
    stage = await run_scorer(settings, stop_on_signals(), burst=args.burst)
    if args.burst:
        print(f"scored {stage.forwarded + stage.dropped + stage.dead_lettered} group(s) of run "
              f"{settings.run!r}: {stage.forwarded} forwarded, {stage.dropped} dropped, "
              f"{stage.dead_lettered} dead-lettered, {stage.left_pending} left pending",
              flush=True)
    return Exit.OK


def rescore_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, ScorerSettings, skip=ONE_SHOT)
    parser.add_argument("--into", required=True, metavar="RUN",
                        help="run whose scored stream receives the rescored groups")


async def rescore(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.rescore import rescore as replay
    from rollq.ops.roles import print_progress
    from rollq.schemas.keys import check_run_name

    settings = settings_for(ScorerSettings, args, environ)
    if settings.reward_config is None:
        print("rollq: rescore needs --reward-config: the reward config to replay the stored "
              "trajectories through", file=sys.stderr)
        return Exit.USAGE
    check_run_name(args.into)
    if args.into == settings.run:
        print("rollq: --into must name another run than --run", file=sys.stderr)
        return Exit.USAGE
    redis = redis_client(settings)
    try:
        runs = await known_runs(redis)
    finally:
        await redis.aclose()
    if settings.run not in runs:
        return not_found(settings.run, runs)
    result = await replay(settings, args.into, progress=print_progress)
    print(f"\nrescored into run {args.into!r}: {result.scored} scored, {result.dead} dead, "
          f"{result.dropped} dropped", file=sys.stderr)
    return Exit.OK


COMMANDS = {
    "workers": ("start an arq worker pool that rolls out groups on vLLM servers",
                workers_flags, workers),
    "feed": ("admit rollout jobs from an env's dataset at the pace the trainer sets",
             feed_flags, feed),
    "score": ("score trajectory groups with a reward config and forward them, exactly once",
              score_flags, score),
    "rescore": ("replay stored trajectories through another reward config into another run",
                rescore_flags, rescore),
}
