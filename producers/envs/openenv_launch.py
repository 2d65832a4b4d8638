"""Serve an installed OpenEnv env package for a rollq worker: ``python openenv_launch.py APP``.

``producers.envs.openenv_server`` runs this file by its path in the env's own Python (the
env package's virtual environment, which need not hold rollq: nothing of rollq is imported
here). ``APP`` is ``MODULE[:ATTRIBUTE]``, the package's ASGI app (``app`` by default), as
OpenEnv's envs keep it in ``<env>/server/app.py``. The package's code runs unchanged:

1. OpenEnv's ``HTTPEnvServer`` is wrapped before ``MODULE`` is imported, so the server the
   package builds with ``create_app`` gets ``--session-timeout`` (OpenEnv's idle-session
   reaper, off unless an app sets it) and, when given, ``--max-concurrent-envs``, through
   OpenEnv's own ``ConcurrencyConfig``.
2. ``GET /rollq/capacity`` answers ``{"active_sessions", "max_sessions",
   "session_timeout_s"}`` from that server: where the worker reads the session limit, and
   where tests count open sessions.
3. It listens on a free loopback port (``--port 0``) and prints one JSON line, ``{"port",
   "max_sessions", "session_timeout_s"}``, on stdout once it serves.
4. It stops when its stdin closes: the worker holds the other end, so a worker that dies,
   by SIGKILL too, takes its server with it (and the server's sessions).
"""

from __future__ import annotations

import os
import sys

# Run by path, this file's folder would come first on sys.path, where rollq's own
# ``openenv.py`` would shadow the openenv package: the working directory takes its place,
# as under ``python -m``.
sys.path[0] = os.getcwd()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

STOP_GRACE_S = 5.0
"""After stdin closes, how long uvicorn gets to stop before the process exits anyway."""


def configure_openenv(session_timeout_s: float | None,
                      max_concurrent_envs: int | None) -> list[Any]:
    """Wrap OpenEnv's ``HTTPEnvServer`` so every server built from now on gets these
    settings; returns the list the built servers are appended to."""
    from openenv.core.env_server import http_server
    from openenv.core.env_server.types import ConcurrencyConfig

    built: list[Any] = []
    original = http_server.HTTPEnvServer.__init__
    signature = inspect.signature(original)

    def init(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments.get("concurrency_config")
        limit = max_concurrent_envs or (given.max_concurrent_envs if given is not None else
                                        bound.arguments.get("max_concurrent_envs")) or 1
        timeout = session_timeout_s if session_timeout_s is not None else (
            given.session_timeout if given is not None else None)
        bound.arguments["max_concurrent_envs"] = None
        bound.arguments["concurrency_config"] = ConcurrencyConfig(
            max_concurrent_envs=limit, session_timeout=timeout)
        original(*bound.args, **bound.kwargs)
        built.append(bound.arguments["self"])

    http_server.HTTPEnvServer.__init__ = init
    return built


def load_app(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute or "app")


def capacity(server: Any) -> dict[str, Any]:
    return {"active_sessions": server.active_sessions,
            "max_sessions": server.max_concurrent_envs,
            "session_timeout_s": server.concurrency_config.session_timeout}


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    built = configure_openenv(args.session_timeout, args.max_concurrent_envs)
    app = load_app(args.app)
    if not built:
        raise SystemExit(f"{args.app} built no OpenEnv server (HTTPEnvServer/create_app)")
    server = built[-1]
    app.add_api_route("/rollq/capacity", lambda: capacity(server), methods=["GET"])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    ready = json.dumps({"port": listener.getsockname()[1], **capacity(server)})

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(ready, flush=True)

    config = uvicorn.Config(app, log_level=args.log_level, ws_ping_interval=args.ws_ping,
                            ws_ping_timeout=args.ws_ping, timeout_graceful_shutdown=3)
    runner = Announcing(config)
    stop_when_stdin_closes(runner)
    await runner.serve(sockets=[listener])


def stop_when_stdin_closes(runner: Any) -> None:
    def watch() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        runner.should_exit = True
        threading.Timer(STOP_GRACE_S, os._exit, (0,)).start()

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("app", help="the env package's ASGI app, MODULE[:ATTRIBUTE]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--session-timeout", type=float, default=None)
    parser.add_argument("--max-concurrent-envs", type=int, default=None)
    parser.add_argument("--ws-ping", type=float, default=20.0,
                        help="WebSocket ping interval and timeout (seconds)")
    parser.add_argument("--log-level", default="warning")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
