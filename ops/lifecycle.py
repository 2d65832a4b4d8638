"""How a role's process lives and stops: the stop signals, and serving an HTTP app until
them. Imports no CLI: the commands in ``ops.cli`` and the roles in ``ops.roles`` call it."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from typing import Any

import structlog

from rollq.schemas import ConfigError
from rollq.schemas.heap import startup_done


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: stop reading, finish the batch in hand, exit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        return stop  # signals reach only the main thread (a command run from a test's thread)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop



HTTP_GRACE_S = 10.0
"""After SIGTERM/SIGINT, how long an HTTP role's requests in flight get to finish (a request
the Atropos API holds through a Redis outage included) before uvicorn cuts them: their
clients retry, and a retried post is deduplicated."""


async def serve_http(app: Any, host: str, port: int, *, metrics_port: int | None = None) -> int:
    """Serve the FastAPI ``app`` with uvicorn until SIGTERM or SIGINT; 0 once it has
    stopped gracefully.

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
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None,
                                           access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=int(HTTP_GRACE_S)))
    listener = _listen(host, port)  # last before the try that closes it

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
    return 0


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
