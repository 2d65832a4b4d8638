"""structlog, configured once per process by the CLI.

JSON lines in production (one object per event, easy to ship), a coloured console in a
terminal. Library modules only call ``structlog.get_logger(...)`` and bind context.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _StderrLogger:
    """Writes to whatever ``sys.stderr`` is at the time (test capture swaps it)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure_logging(
    log_format: Literal["auto", "json", "console"] = "auto", level: str = "info"
) -> None:
    """Configure structlog (and the stdlib root logger, for arq and httpx) once."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            (structlog.processors.format_exc_info if use_json
             else structlog.processors.StackInfoRenderer()),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *args: _StderrLogger(),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(_LEVELS[level], logging.WARNING), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
