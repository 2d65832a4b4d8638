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
import traceback
from collections.abc import Callable, Coroutine, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog

from ops.logging import configure_logging, say_error, uses_json
from ops.settings import CommonSettings, load_settings, redact_url
from schemas import BrokerUnavailable, ConfigError, InferenceUnavailable
from schemas.failures import describe


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


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML config file (see README: Settings)")
    parser.add_argument("--redis-url", help="Redis URL [ROLLQ_REDIS_URL, default "
                        "redis://127.0.0.1:6379/0]")
    parser.add_argument("--run", help="run name [ROLLQ_RUN, default 'default']")
    parser.add_argument("--log-format", choices=["auto", "json", "console"],
                        help="log lines as JSON or for a terminal [ROLLQ_LOG_FORMAT, auto: "
                        "JSON unless stderr is a terminal]")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="[ROLLQ_LOG_LEVEL, info]; debug also prints tracebacks")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="long-running roles serve Prometheus /metrics here "
                        "[ROLLQ_METRICS_PORT, off; 0: any free port]; the 'metrics' extra")


def settings_for(cls: type[Any], args: argparse.Namespace, environ: Mapping[str, str],
                 **overrides: Any) -> Any:
    """Load a role's settings with the common flags, then configure logging from them.

    The settings are also kept on ``args``, so ``main`` can word a failure with them.
    """
    settings = load_settings(
        cls,
        environ=environ,
        config_file=getattr(args, "config", None),
        overrides={"redis_url": getattr(args, "redis_url", None),
                   "run": getattr(args, "run", None),
                   "log_format": getattr(args, "log_format", None),
                   "log_level": getattr(args, "log_level", None),
                   "metrics_port": getattr(args, "metrics_port", None), **overrides},
    )
    configure_logging(settings.log_format, settings.log_level)
    # Every line the command writes carries its run (the handler runs in its own task
    # context, so this binding ends with it).
    structlog.contextvars.bind_contextvars(run=settings.run)
    args.settings = settings
    return settings


def redis_client(settings: CommonSettings) -> aioredis.Redis:
    from ops.connections import open_redis

    return open_redis(settings)


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
            add_common_flags(command)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``rollq`` with ``argv``; returns the exit code.

    Expected failures end in one line that says what to fix and a named exit code; a
    traceback is printed only with ``--log-level debug``. In JSON log mode the line is JSON.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    handler: Handler = args.handler
    try:
        return asyncio.run(handler(args, environ))
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except Exception as exc:  # the CLI edge: every failure becomes a line and an exit code
        code, message = explain(exc, args, environ)
        settings: CommonSettings | None = getattr(args, "settings", None)
        log_format = settings.log_format if settings else (
            getattr(args, "log_format", None) or environ.get("ROLLQ_LOG_FORMAT", "auto"))
        log_level = settings.log_level if settings else (
            getattr(args, "log_level", None) or environ.get("ROLLQ_LOG_LEVEL", "info"))
        json_format = log_format == "json" or (log_format != "console" and uses_json("auto"))
        say_error(message, json_format=json_format, exit_code=int(code),
                  command=getattr(args, "command", None), error=type(exc).__name__)
        if log_level == "debug":
            traceback.print_exception(exc, file=sys.stderr)
        return code


def explain(exc: BaseException, args: argparse.Namespace,
            environ: Mapping[str, str]) -> tuple[Exit, str]:
    """The exit code and the one-line message for a command that raised ``exc``."""
    settings: CommonSettings | None = getattr(args, "settings", None)
    redis_url = redact_url(settings.redis_url if settings else (
        getattr(args, "redis_url", None) or environ.get("ROLLQ_REDIS_URL")
        or "redis://127.0.0.1:6379/0"))
    if isinstance(exc, ConfigError):
        return Exit.CONFIG, str(exc)
    if any(isinstance(e, redis_errors.AuthenticationError | redis_errors.AuthorizationError |
                      redis_errors.NoPermissionError) for e in _chain(exc)):
        return Exit.CONFIG, (f"Redis at {redis_url} refused the credentials or the command: "
                             f"{_cause(exc)}; check the URL's user and password and the ACL")
    if isinstance(exc, BrokerUnavailable | redis_errors.ConnectionError |
                  redis_errors.TimeoutError | ConnectionError):
        return Exit.UNAVAILABLE, (
            f"cannot reach Redis at {redis_url}: {_cause(exc)}; start a server "
            "(redis-server) or point --redis-url / ROLLQ_REDIS_URL at one")
    if isinstance(exc, InferenceUnavailable):
        return Exit.UNAVAILABLE, f"inference unavailable: {_cause(exc)}"
    return Exit.FAILURE, (f"{getattr(args, 'command', 'command')} failed: {describe(exc)} "
                          "(run with --log-level debug for the traceback)")


def _chain(exc: BaseException) -> list[BaseException]:
    found = [exc]
    while found[-1].__cause__ is not None and len(found) < 10:
        found.append(found[-1].__cause__)
    return found


def _cause(exc: BaseException) -> str:
    """The innermost message of an exception chain (redis-py wraps OSErrors)."""
    while exc.__cause__ is not None and str(exc.__cause__):
        exc = exc.__cause__
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
