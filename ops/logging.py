"""structlog, configured once per process by the CLI.

JSON lines in production (one object per event, easy to ship), a coloured console in a
terminal. Library modules only call ``structlog.get_logger(...)`` and bind context.

The standard library's loggers (arq, httpx, uvicorn, asyncio…) go through the same
renderer (structlog's ``ProcessorFormatter``), so with JSON every line a role writes to
stderr is one JSON object. ``say_error`` prints the CLI's one-line failures in the same
format.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import orjson
import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
LogFormat = Literal["auto", "json", "console"]


class _StderrLogger:
    """Writes to whatever ``sys.stderr`` is at the time (test capture swaps it)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler bound to the current ``sys.stderr`` at each record."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def uses_json(log_format: LogFormat) -> bool:
    """Whether ``log_format`` renders JSON here (``auto``: when stderr is not a terminal)."""
    return log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())


def configure_logging(log_format: LogFormat = "auto", level: str = "info") -> None:
    """Configure structlog and the stdlib root logger (arq, httpx, uvicorn) once."""
    use_json = uses_json(log_format)
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            (structlog.processors.format_exc_info if use_json
             else structlog.processors.StackInfoRenderer()),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *args: _StderrLogger(),
        # Not cached: a cached logger keeps the processors it was made with, so a later
        # reconfiguration (structlog.testing.capture_logs in tests) would not reach it.
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([structlog.processors.format_exc_info] if use_json else []),
                    renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # Third-party chatter (arq's per-job lines, httpx's per-request lines) only from warning.
    root.setLevel(max(_LEVELS[level], logging.WARNING))


def say_error(message: str, *, json_format: bool, **fields: Any) -> None:
    """One line on stderr for a command that ends on an expected failure: ``rollq: …`` in
    a terminal, a JSON object (``event: command_failed``) in JSON mode."""
    if json_format:
        document = {"event": "command_failed", "level": "error", "message": message, **fields}
        print(orjson.dumps(document, default=str).decode(), file=sys.stderr, flush=True)
    else:
        print(f"rollq: {message}", file=sys.stderr, flush=True)
