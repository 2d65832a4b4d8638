"""An OpenEnv env server that a worker runs itself, from an installed env package.

``openenv:MODULE[:APP]`` names the package's ASGI app (OpenEnv envs keep it in
``<env>/server/app.py``); the worker starts it as a child process, a local process (no
Docker, no hub), on a free loopback port, the first time an episode needs it:
``PYTHON openenv_launch.py APP`` (``producers/envs/openenv_launch.py``, run by its path in
``python``, the env's own environment when its dependencies clash with the worker's; by
default the worker's Python). The launcher sets OpenEnv's ``session_timeout`` on the server
the package builds (and ``max_concurrent_envs`` when given) and reports the session limit.

The child dies with its worker: it stops when its stdin closes, and the worker holds the
pipe, so a worker that exits, crashes or is killed with SIGKILL leaves no server (and no
session) behind. A server that died (an env that crashed its process) is started again
by the next episode that needs it, logged as ``openenv_server_restarted``. A server that
cannot start (a wrong module, an import error in the env, a setting OpenEnv refuses) is a
``ConfigError`` quoting the end of its stderr: the worker stops with exit 78.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import structlog

from rollq.schemas import ConfigError

log = structlog.get_logger("rollq.openenv")

STDERR_LINES = 40
"""Lines of the server's output kept for the message of a failed start or a restart."""


def launcher_path() -> str:
    """Path of ``openenv_launch.py``, which the env's Python runs by path."""
    return str(resources.files("rollq.producers.envs").joinpath("openenv_launch.py"))


@dataclass
class LocalEnvServer:
    """A child-process OpenEnv server (module docstring).

    - ``app``: ``MODULE[:ATTRIBUTE]`` of the package's ASGI app.
    - ``python``: the interpreter to run it with (the env's environment).
    - ``session_timeout_s``: OpenEnv's idle-session timeout for it (None: the app's own).
    - ``max_concurrent_envs``: its session limit (None: the app's own).
    - ``start_timeout_s``: longest wait for it to serve.
    - ``ws_ping_s``: its WebSocket ping interval and timeout.
    """

    app: str
    python: str = sys.executable
    session_timeout_s: float | None = 60.0
    max_concurrent_envs: int | None = None
    start_timeout_s: float = 120.0
    ws_ping_s: float = 20.0
    url: str | None = field(default=None, init=False)
    """``http://127.0.0.1:PORT`` once started."""
    max_sessions: int | None = field(default=None, init=False)
    """The server's ``max_concurrent_envs``, as it reported it when it started."""
    starts: int = field(default=0, init=False)
    """How many times it was started (a restart after it died counts)."""
    _process: asyncio.subprocess.Process | None = field(default=None, init=False)
    _stderr: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES),
                                init=False)
    _drains: list[asyncio.Task[None]] = field(default_factory=list, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def ensure_started(self) -> str:
        """The server's URL, starting it (again, when it died) first."""
        async with self._lock:
            if self._process is not None and self._process.returncode is None:
                assert self.url is not None
                return self.url
            if self._process is not None:
                log.warning("openenv_server_restarted", app=self.app,
                            exit_code=self._process.returncode,
                            stderr=" | ".join(list(self._stderr)[-5:]))
            await self._start()
            assert self.url is not None
            return self.url

    async def stop(self) -> None:
        """Stop the server: its stdin closes (it stops on that), then SIGKILL after 10 s."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
        await asyncio.gather(*self._drains, return_exceptions=True)

    async def _start(self) -> None:
        command = [self.python, launcher_path(), self.app, "--port", "0",
                   "--ws-ping", str(self.ws_ping_s)]
        if self.session_timeout_s is not None:
            command += ["--session-timeout", str(self.session_timeout_s)]
        if self.max_concurrent_envs is not None:
            command += ["--max-concurrent-envs", str(self.max_concurrent_envs)]
        self._stderr.clear()
        try:
            process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise ConfigError(f"cannot run the OpenEnv server's Python {self.python!r}: "
                              f"{exc}") from exc
        self._process, self.starts = process, self.starts + 1
        assert process.stdout is not None and process.stderr is not None
        self._drains = [asyncio.create_task(self._keep_output(process.stderr))]
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.start_timeout_s)
            ready: dict[str, Any] = json.loads(line) if line else {}
        except (TimeoutError, ValueError):
            ready = {}
        if "port" not in ready:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            await asyncio.gather(*self._drains, return_exceptions=True)
            raise ConfigError(
                f"the OpenEnv server {self.app!r} did not start (run with {self.python}; "
                f"exit code {process.returncode}): " + (" | ".join(self._stderr) or
                                                        "no output"))
        # after the ready line, whatever the env prints is kept as its stderr is: a pipe
        # nobody reads would block the server once full
        self._drains.append(asyncio.create_task(self._keep_output(process.stdout)))
        self.url = f"http://127.0.0.1:{int(ready['port'])}"
        self.max_sessions = ready.get("max_sessions")
        log.info("openenv_server_started", app=self.app, url=self.url,
                 max_concurrent_envs=self.max_sessions,
                 session_timeout_s=ready.get("session_timeout_s"))

    async def _keep_output(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self._stderr.append(line.decode(errors="replace").rstrip())
