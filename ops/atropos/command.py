"""``rollq atropos-api`` (served by ``ops.invocation.serve_http``) and ``rollq
atropos-env`` (``ops.atropos.serve_env`` in place of this process): flags and handlers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from ops.invocation import serve_http, settings_for

HELP = ("serve the Atropos trajectory API (atroposlib 0.4.0's paths and shapes) on the run's "
        "streams: envs in `serve` mode post here, Atropos trainers poll /batch; durable")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on [127.0.0.1]")
    parser.add_argument("--port", type=int, help="port to listen on [8000]")
    parser.add_argument("--rewards", choices=["env", "bridge"],
                        help="env: the env's own scores are the rewards (straight to the "
                        "scored stream); bridge: rollq's scorers (`rollq score`) reward the "
                        "groups, the env's score available as component env_score [env]")
    parser.add_argument("--consumer-group", help="consumer group of /batch [atropos]")
    parser.add_argument("--inference", help="vLLM base URL(s), comma-separated, served to "
                        "Atropos envs under /inference (server_type vllm: base_url "
                        "http://HOST:PORT/inference/v1) [none]")
    parser.add_argument("--model", help="served model name [asked from /v1/models]")


async def atropos_api(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.atropos.app import create_app
    from ops.settings import AtroposApiSettings

    settings: AtroposApiSettings = settings_for(
        AtroposApiSettings, args, environ, host=args.host, port=args.port,
        rewards=args.rewards, consumer_group=args.consumer_group,
        inference=args.inference.split(",") if args.inference else None, model=args.model)
    return await serve_http(create_app(settings), settings.host, settings.port,
                            metrics_port=settings.metrics_port)


ENV_HELP = ("run an Atropos env as its authors do (`python ENV serve ARGS`), with "
            "atroposlib 0.4.0's quirks fixed: --openai.base_url is used even when the env's "
            "config_init returns a single server config (else it goes to "
            "localhost:9004-9007), tokenize_for_trainer works under transformers 5, and the "
            "env's API calls are retried through an API restart")


def add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("env", help="the env: a file (environments/gsm8k_server.py) or "
                        "MODULE:CLASS of a BaseEnv subclass")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the env CLI's own command and flags (serve "
                        "--env.rollout_server_url http://API --openai.base_url "
                        "http://API/inference/v1 …)")


async def atropos_env(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Replace this process with the env's (its signals, exit code and output are the
    env's own; atroposlib runs its own event loop)."""
    argv = [sys.executable, "-m", "ops.atropos.serve_env", args.env, *args.args]
    os.execve(sys.executable, argv, dict(environ))
