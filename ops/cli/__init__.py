"""The ``rollq`` command line: parses, wires, and maps errors to named exit codes.

One convention for every command: a module of this package holds its flags (a function
given its parser) and its handler (a coroutine given the parsed flags and the environment,
returning the exit code), listed in the module's ``COMMANDS``; ``COMMANDS`` here joins them.
A handler builds its role's settings (flags > ``ROLLQ_*`` variables > config file >
defaults, ``ops.cli.common``), and calls one function of ``ops``. ``main(argv)`` returns
the exit code, so tests call it without a subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import redis.exceptions as redis_errors

from rollq.ops.cli import dead, inspect, local, roles, runs, servers
from rollq.ops.cli.common import Exit, Handler
from rollq.ops.logging import say_error, uses_json
from rollq.ops.settings import CommonSettings, redact_url
from rollq.schemas import BrokerUnavailable, ConfigError, InferenceUnavailable
from rollq.schemas.errors import tls_failure, tls_refused
from rollq.schemas.failures import error_line
from rollq.schemas.heap import freeze_after_startup

__all__ = ["COMMANDS", "Exit", "build_parser", "explain", "main", "run"]

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Handler]
"""A command's help line, the function that adds its flags, its handler."""

COMMANDS: dict[str, Command] = {
    **local.COMMANDS, **roles.COMMANDS, **inspect.COMMANDS, **dead.COMMANDS, **runs.COMMANDS,
    **servers.COMMANDS}


def build_parser() -> argparse.ArgumentParser:
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
    for name, (help_text, add_flags, handler) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_flags(command)
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
    failure = tls_failure(exc)
    if failure is not None:  # before the outage: a certificate is a setting to fix
        return Exit.CONFIG, f"Redis at {redis_url}: {tls_refused(failure)}"
    if isinstance(exc, BrokerUnavailable | redis_errors.ConnectionError |
                  redis_errors.TimeoutError | ConnectionError):
        return Exit.UNAVAILABLE, (
            f"cannot reach Redis at {redis_url}: {_cause(exc)}; start a server "
            "(redis-server) or point --redis-url / ROLLQ_REDIS_URL at one")
    if isinstance(exc, InferenceUnavailable):
        return Exit.UNAVAILABLE, f"inference unavailable: {_cause(exc)}"
    extra = EXTRAS.get((getattr(exc, "name", None) or "").partition(".")[0])
    if isinstance(exc, ModuleNotFoundError) and extra is not None:
        return Exit.CONFIG, (f"rollq {getattr(args, 'command', '')} needs {exc.name!r}, which "
                             f"the {extra!r} extra installs: pip install 'rollq[{extra}]'")
    return Exit.FAILURE, (f"{getattr(args, 'command', 'command')} failed: {error_line(exc)} "
                          "(run with --log-level debug for the traceback)")


EXTRAS = {"arq": "roles", "math_verify": "roles", "fastapi": "servers", "uvicorn": "servers",
          "starlette": "servers", "torch": "train", "transformers": "train",
          "matplotlib": "train", "safetensors": "train", "openai": "train",
          "prometheus_client": "metrics", "atroposlib": "atropos", "gem": "gem"}
"""The extra that installs a module a command failed to import (pyproject.toml)."""


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


def run() -> NoReturn:
    """The ``rollq`` program (console script, ``python -m ops``): ``main`` with the
    start-up heap frozen in the roles (``schemas.heap``)."""
    freeze_after_startup()
    sys.exit(main())


if __name__ == "__main__":
    run()
