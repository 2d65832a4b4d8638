"""What every rollq subcommand shares: exit codes, the common flags, settings and a client.

The command modules (``ops.commands``, ``ops.dead_cli``, ``ops.runs``, the Atropos API's and
the gateway's) import these from here; ``ops.cli`` puts them together into the parser, so
the imports run one way: ``ops.cli`` -> command modules -> ``ops.invocation``.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog

from ops.logging import configure_logging
from ops.settings import CommonSettings, load_settings
from schemas import ConfigError
from schemas.heap import startup_done


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


def add_common_flags(parser: argparse.ArgumentParser, *, metrics: bool = False) -> None:
    """The flags every command shares; ``metrics``: also ``--metrics-port``, for the
    long-running roles only (a one-shot command would have nothing to serve)."""
    parser.add_argument("--config", type=Path,
                        help="YAML config file (see docs/reference/settings.md)")
    parser.add_argument("--redis-url", help="Redis URL [ROLLQ_REDIS_URL, default "
                        "redis://127.0.0.1:6379/0]")
    parser.add_argument("--run", help="run name [ROLLQ_RUN, default 'default']")
    parser.add_argument("--log-format", choices=["auto", "json", "console"],
                        help="log lines as JSON or for a terminal [ROLLQ_LOG_FORMAT, auto: "
                        "JSON unless stderr is a terminal]")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="[ROLLQ_LOG_LEVEL, info]; debug also prints tracebacks")
    if not metrics:
        return
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus /metrics here "
                        "[ROLLQ_METRICS_PORT, off; 0: any free port]; the 'metrics' extra "
                        "(gateway and atropos-api: on their own --port instead)")


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


HTTP_GRACE_S = 10.0
"""After SIGTERM/SIGINT, how long an HTTP role's requests in flight get to finish (a request
the Atropos API holds through a Redis outage included) before uvicorn cuts them: their
clients retry, and a retried post is deduplicated."""


async def serve_http(app: Any, host: str, port: int, *, metrics_port: int | None = None) -> int:
    """Serve the FastAPI ``app`` with uvicorn until SIGTERM or SIGINT; ``Exit.OK`` once it
    has stopped gracefully.

    Failures to start reach the CLI's error mapping like every other command's, not
    uvicorn's own exit (status 3, the code rollq uses for "not found"): the port is bound
    here first (in use: ``ConfigError``), and the app's lifespan runs here around uvicorn
    (Redis down: ``BrokerUnavailable``, exit 69; a bad setting: ``ConfigError``, exit 78).

    The stop signals are handled from before the lifespan starts: one that arrives while it
    starts stops the server as soon as it is up. uvicorn, once stopped, raises the signal
    again for the handler it found, which here only asks for the stop already made (by
    default the signal would end the process, status 143), so the command exits 0 when
    told to stop, like every rollq role. ``metrics_port`` (a common setting) is not used:
    the app answers ``GET /metrics`` on its own port, and a warning says so.
    """
    import uvicorn

    if metrics_port is not None:
        structlog.get_logger("rollq").warning(
            "metrics_port_ignored", metrics_port=metrics_port,
            reason=f"this role answers GET /metrics on its own port ({port})")
    listener = _listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None,
                                           access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=int(HTTP_GRACE_S)))

    def stop(sig: int, frame: Any) -> None:
        server.should_exit = True

    signals = (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()  # signals reach only it
    previous = {sig: signal.signal(sig, stop) for sig in signals} if main else {}
    try:
        async with app.router.lifespan_context(app):
            startup_done()
            await server.serve(sockets=[listener])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.close()
    return Exit.OK


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; ``ConfigError`` naming it when it cannot be
    had (in use, no such interface, a privileged port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (set "
                          "another --port or --host)") from None
    return listener
