"""One OpenEnv session: a WebSocket on an env server's ``/ws``, spoken as OpenEnv 0.10 does.

The protocol (``openenv.core.env_server.http_server``): each WebSocket connection is one
session with its own env instance; the client sends ``{"type": "reset", "data": {...}}``,
``{"type": "step", "data": ACTION}`` and ``{"type": "close"}``, and the server answers each
with ``{"type": "observation", "data": {"observation", "reward", "done"}}`` or
``{"type": "error", "data": {"message", "code", ...}}``. A server at its
``max_concurrent_envs`` accepts the connection, sends a ``CAPACITY_REACHED`` error naming
``max_sessions`` and closes it.

rollq speaks it with ``websockets`` rather than OpenEnv's ``EnvClient``, whose errors are
``RuntimeError`` strings (the refusal's ``max_sessions``, which the kind paces itself by, is
dropped) and whose session is only as alive as its last step (below). Failures are
translated where they enter:

- the server cannot be reached, the WebSocket closes mid-episode, a message gets no answer
  within ``message_timeout_s``, the server could not make the session's env
  (``FACTORY_ERROR``, ``SESSION_ERROR``): ``EnvServerUnavailable`` (``env_unavailable``:
  the job is retried, then dead-lettered);
- ``CAPACITY_REACHED``: ``ServerFull`` (the caller waits for a slot);
- an action the env's model refuses (``VALIDATION_ERROR``): ``InvalidAction`` (the
  model's fault: the episode ends with the kind's ``invalid_action_reward``);
- the env raised in ``reset``/``step`` (``EXECUTION_ERROR``) or the server speaks another
  protocol: ``EnvServerError`` (``unexpected_error`` after the job's tries, as an env that
  raises in-process).

**Keep-alive.** OpenEnv's ``session_timeout`` reaper counts a session idle from its last
reset or step, WebSocket or not: a model turn longer than the timeout has its session
destroyed under it (the slot is freed while the episode still plays on it). While the
episode waits for the model, ``kept_alive()`` sends a JSON-RPC request every
``keepalive_s`` over the session's own ``mcp`` channel (the method ``rollq/keepalive``,
which the server answers "method not found" without touching the env, and which counts as
the session's activity). The WebSocket's own ping/pong runs in ``websockets``' background
task, answered while the worker's event loop waits on inference (OpenEnv #362 was a client
whose generation blocked its thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rollq.schemas import RollqError, TransientError
from rollq.schemas.failures import ENV_REWARD_MISSING, ENV_UNAVAILABLE
from rollq.schemas.tasks import beside

CLOSE_WAIT_S = 2.0
"""How long a closing session waits for the server to end it (then it closes itself)."""
KEEPALIVE = {"jsonrpc": "2.0", "method": "rollq/keepalive", "params": {}, "id": "rollq"}
"""The JSON-RPC request ``kept_alive`` sends (module docstring)."""


_ANSWERS = {"reset": "observation", "step": "observation"}
"""The answer's ``type`` to each message's (the same where not listed: ``mcp``)."""


class EnvServerUnavailable(TransientError):
    """An env server could not be reached or dropped a session (module docstring)."""

    reason = ENV_UNAVAILABLE


class EnvRewardMissing(TransientError):
    """An env ended an episode without a reward: its scoring failed; never a reward of 0."""

    reason = ENV_REWARD_MISSING


class EnvServerError(RollqError):
    """The env raised in reset/step, or the server answered outside the protocol."""


class ServerFull(Exception):
    """The server refused a session: it holds ``active_sessions`` of ``max_sessions``."""

    def __init__(self, message: str, max_sessions: int | None,
                 active_sessions: int | None) -> None:
        super().__init__(message)
        self.max_sessions, self.active_sessions = max_sessions, active_sessions


class InvalidAction(Exception):
    """The model's reply is not an action the env accepts (its detail says why)."""


@dataclass(frozen=True)
class StepOutcome:
    """An observation with its reward (None: the env gave none) and whether it ended."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


def websocket_url(url: str) -> str:
    """The ``ws(s)://.../ws`` URL of a server given as ``http(s)://HOST:PORT[/PATH]`` or
    ``ws(s)://...`` (``/ws`` appended unless the path ends with it)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    return urlunsplit((scheme, parts.netloc, path if path.endswith("/ws") else path + "/ws",
                       "", ""))


def http_url(url: str) -> str:
    """The ``http(s)://`` base URL of a server given either way (no ``/ws``)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/").removesuffix("/ws"), "",
                       ""))


class EnvSession:
    """One open session (module docstring). ``open`` connects; ``reset``, ``step``; ``close``
    ends the session on the server (always call it: ``open_session`` does)."""

    def __init__(self, url: str, connection: Any, *, message_timeout_s: float,
                 keepalive_s: float | None) -> None:
        self.url = url
        self._connection = connection
        self._message_timeout_s = message_timeout_s
        self._keepalive_s = keepalive_s
        self._lock = asyncio.Lock()  # one message in flight: steps and keep-alives
        self._broken: str | None = None  # an answer never came: the next would be out of step

    @classmethod
    async def open(cls, url: str, *, connect_timeout_s: float = 10.0,
                   message_timeout_s: float = 300.0,
                   keepalive_s: float | None = 10.0) -> EnvSession:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake, InvalidURI

        target = websocket_url(url)
        try:
            connection = await connect(target, open_timeout=connect_timeout_s,
                                       max_size=2**27, proxy=None)
        except InvalidURI as exc:
            raise EnvServerError(f"{target} is not a WebSocket URL: {exc}") from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise EnvServerUnavailable(f"env server {target} unreachable: "
                                       f"{type(exc).__name__}: {exc}") from exc
        return cls(target, connection, message_timeout_s=message_timeout_s,
                   keepalive_s=keepalive_s)

    async def reset(self, **data: Any) -> StepOutcome:
        """Reset the session's env (OpenEnv passes the keys its ``reset`` accepts)."""
        return _outcome(await self._exchange({"type": "reset", "data": data}), self.url)

    async def step(self, action: dict[str, Any]) -> StepOutcome:
        return _outcome(await self._exchange({"type": "step", "data": action}), self.url)

    @contextlib.asynccontextmanager
    async def kept_alive(self) -> AsyncIterator[None]:
        """Keep the session active on the server for the block (module docstring); a
        keep-alive that fails leaves the failure to the next step, which meets it."""
        if self._keepalive_s is None:
            yield
            return
        async with beside(self._keep_alive(self._keepalive_s)):
            yield

    async def close(self) -> None:
        """End the session: a ``close`` message, then the server closes the WebSocket once
        it has destroyed the session (its env closed, its slot free), or the client does
        after ``CLOSE_WAIT_S``; best effort, and finished even when the caller is
        cancelled."""
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await self._connection.send(json.dumps({"type": "close"}))
                    await self._connection.wait_closed()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await self._connection.close()
        finally:
            # a server that never answers the closing handshake (a blocked loop) leaves
            # ``close()`` timed out with the TCP connection open: dropped, its socket would
            # be left to the garbage collector (a ResourceWarning); a no-op once closed
            self._connection.transport.abort()

    async def _keep_alive(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._exchange({"type": "mcp", "data": KEEPALIVE})
            except (EnvServerUnavailable, EnvServerError):
                return  # the next step meets the same failure and says so

    async def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        kind = message["type"]
        async with self._lock:
            if self._broken is not None:
                raise EnvServerUnavailable(self._broken)
            try:
                await self._connection.send(json.dumps(message))
            except ConnectionClosed:
                pass  # a refused session sends its reason, then closes: read it below
            try:
                raw = await asyncio.wait_for(self._connection.recv(), self._message_timeout_s)
            except TimeoutError:
                self._broken = (f"env server {self.url} did not answer a {kind} within "
                                f"{self._message_timeout_s:g} s")
                raise EnvServerUnavailable(self._broken) from None
            except ConnectionClosed as exc:
                raise EnvServerUnavailable(f"env server {self.url} closed the session's "
                                           f"WebSocket during a {kind}: {exc}") from exc
        try:
            reply = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise EnvServerError(f"env server {self.url} answered a {kind} with something "
                                 f"that is not JSON: {str(raw)[:200]!r}") from exc
        if isinstance(reply, dict) and reply.get("type") == "error":
            raise _error(reply.get("data") or {}, kind, self.url)
        if (not isinstance(reply, dict) or not isinstance(reply.get("data"), dict)
                or reply.get("type") != _ANSWERS.get(kind, kind)):
            raise EnvServerError(f"env server {self.url} answered a {kind} outside OpenEnv's "
                                 f"protocol: {str(raw)[:200]!r}")
        return reply


def _error(data: dict[str, Any], kind: str, url: str) -> Exception:
    code, message = str(data.get("code", "")), str(data.get("message", ""))
    if code == "CAPACITY_REACHED":
        return ServerFull(message, _int(data.get("max_sessions")),
                          _int(data.get("active_sessions")))
    if code == "VALIDATION_ERROR":
        errors = data.get("errors") or []
        return InvalidAction(f"{message}: {json.dumps(errors)[:500]}" if errors else message)
    if code in ("FACTORY_ERROR", "SESSION_ERROR"):
        return EnvServerUnavailable(f"env server {url} could not open a session ({code}): "
                                    f"{message}")
    return EnvServerError(f"env server {url} failed a {kind} ({code or 'no code'}): {message}")


def _outcome(reply: dict[str, Any], url: str) -> StepOutcome:
    data = reply["data"]
    observation, reward = data.get("observation"), data.get("reward")
    if not isinstance(observation, dict):
        raise EnvServerError(f"env server {url} sent an observation that is not an object: "
                             f"{str(observation)[:200]!r}")
    if reward is not None and (not isinstance(reward, int | float)
                               or not math.isfinite(reward)):
        raise EnvServerError(f"env server {url} sent a reward that is not a finite number: "
                             f"{reward!r}")
    return StepOutcome(observation=observation,
                       reward=None if reward is None else float(reward),
                       done=bool(data.get("done")))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
