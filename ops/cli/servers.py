"""``rollq atropos-api`` and ``rollq gateway`` (HTTP roles, served by
``ops.lifecycle.serve_http``) and ``rollq atropos-env`` (``ops.atropos.serve_env`` in place
of this process)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping

from rollq.ops.cli.common import Handler, add_settings_flags, settings_for
from rollq.ops.lifecycle import serve_http
from rollq.ops.settings import AtroposApiSettings, GatewaySettings

ATROPOS_API_HELP = (
    "serve the Atropos trajectory API (atroposlib 0.4.0's paths and shapes) on the run's "
    "streams: envs in `serve` mode post here, Atropos trainers poll /batch; durable")


def http_role(model: type[AtroposApiSettings | GatewaySettings],
              app_module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Handler]:
    """The flags and handler of an HTTP role: its settings, then its app (``create_app``
    of ``app_module``, imported when run: FastAPI is the 'servers' extra) served until a
    stop signal."""

    def flags(parser: argparse.ArgumentParser) -> None:
        add_settings_flags(parser, model)

    async def serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
        create_app = importlib.import_module(app_module).create_app
        settings = settings_for(model, args, environ)
        return await serve_http(create_app(settings), settings.host, settings.port,
                                metrics_port=settings.metrics_port)

    return flags, serve


ATROPOS_ENV_HELP = (
    "run an Atropos env as its authors do (`python ENV serve ARGS`), with atroposlib "
    "0.4.0's quirks fixed: --openai.base_url is used even when the env's config_init returns "
    "a single server config (else it goes to localhost:9004-9007), tokenize_for_trainer works "
    "under transformers 5, and the env's API calls are retried through an API restart")


def atropos_env_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("env", help="the env: a file (environments/gsm8k_server.py) or "
                        "MODULE:CLASS of a BaseEnv subclass")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the env CLI's own command and flags (serve "
                        "--env.rollout_server_url http://API --openai.base_url "
                        "http://API/inference/v1 …)")


async def atropos_env(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Replace this process with the env's (its signals, exit code and output are the
    env's own; atroposlib runs its own event loop)."""
    argv = [sys.executable, "-m", "rollq.ops.atropos.serve_env", args.env, *args.args]
    os.execve(sys.executable, argv, dict(environ))


GATEWAY_HELP = (
    "serve the capturing OpenAI-compatible gateway in front of vLLM servers: each episode "
    "gets its own base URL (POST /episodes), every call's tokens are recorded (POST "
    "/episodes/<id>/close returns them); with --sessions, agents outside rollq's workers open "
    "episodes (POST /sessions) kept in Redis")


COMMANDS = {
    "atropos-api": (ATROPOS_API_HELP, *http_role(AtroposApiSettings, "rollq.ops.atropos.app")),
    "atropos-env": (ATROPOS_ENV_HELP, atropos_env_flags, atropos_env),
    "gateway": (GATEWAY_HELP, *http_role(GatewaySettings, "rollq.ops.gateway.app")),
}
