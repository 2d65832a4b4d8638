"""The ``rollq`` command line: parses, wires, and maps errors to named exit codes.

Each subcommand builds its role's settings (flags > ``ROLLQ_*`` variables > config file >
defaults), configures logging once, and hands over to the role's module. ``main(argv)``
returns the exit code, so tests call it without a subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from ops.logging import configure_logging
from ops.settings import CommonSettings, load_settings
from schemas import BrokerUnavailable, ConfigError, InferenceUnavailable


class Exit(IntEnum):
    """Exit codes of every rollq command."""

    OK = 0
    FAILURE = 1  # the command ran and failed (e.g. a test run of the demo did not learn)
    USAGE = 2  # argparse's own code for bad flags
    NOT_FOUND = 3  # the run (or entry) asked for does not exist
    UNAVAILABLE = 69  # Redis or the inference servers cannot be reached (EX_UNAVAILABLE)
    CONFIG = 78  # invalid settings or reward config (EX_CONFIG)
    INTERRUPTED = 130


Handler = Callable[[argparse.Namespace, Mapping[str, str]], Coroutine[Any, Any, int]]


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML config file (see README: Settings)")
    parser.add_argument("--redis-url", help="Redis URL [ROLLQ_REDIS_URL, default "
                        "redis://127.0.0.1:6379/0]")
    parser.add_argument("--run", help="run name [ROLLQ_RUN, default 'default']")


def settings_for(cls: type[Any], args: argparse.Namespace, environ: Mapping[str, str],
                 **overrides: Any) -> Any:
    """Load a role's settings with the common flags, then configure logging from them."""
    settings = load_settings(
        cls,
        environ=environ,
        config_file=getattr(args, "config", None),
        overrides={"redis_url": getattr(args, "redis_url", None),
                   "run": getattr(args, "run", None), **overrides},
    )
    configure_logging(settings.log_format, settings.log_level)
    return settings


def redis_client(settings: CommonSettings) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    return client


def build_parser() -> argparse.ArgumentParser:
    from ops import commands  # the handlers import the heavier role modules

    parser = argparse.ArgumentParser(
        prog="rollq",
        description="rollq: a rollout bus on Redis streams for GRPO-style training of "
        "language models. Env workers generate groups on vLLM, scorers reward them, "
        "trainers pull batches.",
        epilog="Every setting can also come from a ROLLQ_<NAME> environment variable or "
        "a --config YAML file. Exit codes: 0 ok, 1 failure, 2 usage, 3 not found, "
        "69 Redis/inference unavailable, 78 bad config.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in commands.COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name not in commands.NO_COMMON_FLAGS:
            _common(command)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``rollq`` with ``argv``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    handler: Handler = args.handler
    try:
        return asyncio.run(handler(args, environ))
    except ConfigError as exc:
        print(f"rollq: {exc}", file=sys.stderr)
        return Exit.CONFIG
    except BrokerUnavailable as exc:
        print(f"rollq: cannot reach Redis: {exc}\n  start a server (redis-server) or point "
              "--redis-url / ROLLQ_REDIS_URL at one", file=sys.stderr)
        return Exit.UNAVAILABLE
    except InferenceUnavailable as exc:
        print(f"rollq: inference unavailable: {exc}", file=sys.stderr)
        return Exit.UNAVAILABLE
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
