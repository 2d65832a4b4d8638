"""``rollq atropos-api``: flags and the handler (served by ``ops.invocation.serve_http``)."""

from __future__ import annotations

import argparse
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
