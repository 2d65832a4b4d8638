"""``openenv:URL`` and ``openenv:MODULE[:APP]``: OpenEnv envs, one server session per episode.

- **The server**: ``openenv:ws://HOST:PORT`` (or ``wss``, ``http``, ``https``) is one that
  runs already; ``openenv:MODULE[:APP]`` is an installed env package's ASGI app, which the
  worker runs itself as a local child process (``producers.envs.openenv_server``; no
  Docker, no hub) with OpenEnv's ``session_timeout`` set, and stops with it.
- **Items and groups**: item ``i`` is ``reset(seed=first_seed + i, **reset_options)``
  (``size`` items). A group is ``group_size`` sessions reset with that seed, one episode
  each on the multi-turn bridge (``producers.envs.multiturn``: token-in/token-out, the
  env's observations masked, exact token capture). Every session of a group must start
  from the same observation; an env whose ``reset`` ignores the seed cannot make a group
  (``ConfigError``).
- **Turns**: the model's reply becomes the env's action through the ``action`` parser, an
  observation the next user message through the ``observation`` renderer
  (``producers.envs.openenv_text``); each step's reward is the turn's reward (a null reward
  before the end counts 0), and the episode ends when the env says ``done`` (or at the
  bridge's limits: its return is then the rewards so far). A reply that is no action ends
  the episode with ``invalid_action_reward``. Score the return with ``env_return``.
- **Concurrency**: a worker never holds more sessions on a server than it allows. The
  limit is the one a server the worker started reports, else the first refusal's
  (OpenEnv's ``CAPACITY_REACHED`` names its ``max_sessions``), capped by ``max_sessions``.
  A group larger than the limit waits for free slots, and the worker says so once
  (``openenv_sessions_limited``, naming ``max_concurrent_envs``). A session refused because
  other clients hold the slots is tried again, backing off, for up to ``session_wait_s``.
- **No leaks**: a session is closed when its episode ends, fails or is cancelled (a job
  timeout, SIGTERM past the grace period); a killed worker's sockets are closed by its OS,
  which ends its sessions on the server at once, and a server it started exits with it; a
  connection left half-open (a host that vanished) is ended by the server's
  ``session_timeout``. While the model generates, the session is kept alive
  (``openenv_session``): OpenEnv counts a session idle from its last step.
- **Failures**, never a reward of 0: a server down, a WebSocket closed mid-episode, no
  answer, no free session in time are ``env_unavailable``; an episode that ends with a
  null reward is ``env_reward_missing``; both retried with the job, then dead-lettered. An
  env that raises in ``reset``/``step`` is ``unexpected_error`` after the job's tries.

Options: ``size`` (1000), ``first_seed`` (0), ``reset_options`` (more ``reset`` arguments),
``action`` (``text``), ``observation`` (automatic), ``invalid_action_reward`` (-1.0),
``max_sessions``, ``session_wait_s`` (300), ``connect_timeout_s`` (10),
``message_timeout_s`` (300: one reset or step), ``keepalive_s`` (10; null: off); the
bridge's ``system_prompt``, ``max_episode_turns`` (100), ``max_completion_tokens``,
``truncated_turn``, ``truncated_turn_penalty``; for a server the worker starts: ``python``
(the env's own interpreter; default the worker's), ``session_timeout_s`` (60),
``max_concurrent_envs`` (the app's own), ``start_timeout_s`` (120).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from rollq.producers.envs.base import Item, PolicyVersion, Rollout
from rollq.producers.envs.kinds import bridge_runner, require
from rollq.producers.envs.multiturn import EpisodeRunner, StepResult
from rollq.producers.envs.observations import Observation, observation_text
from rollq.producers.envs.openenv_server import LocalEnvServer
from rollq.producers.envs.openenv_session import (
    EnvRewardMissing,
    EnvServerUnavailable,
    EnvSession,
    InvalidAction,
    ServerFull,
    StepOutcome,
    http_url,
)
from rollq.producers.envs.openenv_text import ActionParser, Renderer, action_parser, renderer
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import Completion, ConfigError

log = structlog.get_logger("rollq.openenv")

_URL = re.compile(r"^(wss?|https?)://")
_APP = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$")
_SESSION_OPTIONS = {"max_sessions": None, "session_wait_s": 300.0, "connect_timeout_s": 10.0,
                    "message_timeout_s": 300.0, "keepalive_s": 10.0}
_SERVER_OPTIONS = ("python", "session_timeout_s", "max_concurrent_envs", "start_timeout_s")


class SessionSlots:
    """The sessions a worker holds on one server, at most ``limit`` (None: not known yet):
    a slot is taken before a session opens and given back when it closes."""

    def __init__(self, cap: int | None) -> None:
        self.cap, self.limit, self.held = cap, cap, 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def learn(self, server_limit: int) -> None:
        """The server allows ``server_limit`` sessions (at most ``cap`` are taken)."""
        self.limit = server_limit if self.cap is None else min(self.cap, server_limit)
        self._wake()

    async def acquire(self) -> None:
        while self.limit is not None and self.held >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        self._wake()

    def _wake(self) -> None:  # every waiter checks again: the limit may have changed
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class OpenEnvEpisode:
    """One session's episode as a ``MultiTurnEnv`` for the bridge (already reset)."""

    session: EnvSession
    observation: Mapping[str, Any]
    parse: ActionParser
    render: Renderer
    invalid_action_reward: float
    steps: int = 0

    async def reset(self, seed: int) -> Observation:
        return self.render(self.observation)

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        try:
            outcome = await self.session.step(self.parse(action, self.observation))
        except InvalidAction as exc:
            return "", self.invalid_action_reward, True, False, {"invalid_action": str(exc)}
        if outcome.done and outcome.reward is None:
            raise EnvRewardMissing(f"env server {self.session.url} ended the episode at step "
                                   f"{self.steps} with no reward (its scoring failed)")
        self.observation = outcome.observation
        return (self.render(outcome.observation), outcome.reward or 0.0, outcome.done, False,
                {"observation": outcome.observation})


@dataclass
class OpenEnvEnv:
    """OpenEnv episodes as an ``Env`` (module docstring)."""

    name: str
    url: str | None
    server: LocalEnvServer | None
    runner: EpisodeRunner
    action: str = "text"
    render: Renderer = field(default=renderer(None))
    size: int = 1000
    first_seed: int = 0
    reset_options: dict[str, Any] = field(default_factory=dict)
    invalid_action_reward: float = -1.0
    max_sessions: int | None = None
    session_wait_s: float = 300.0
    connect_timeout_s: float = 10.0
    message_timeout_s: float = 300.0
    keepalive_s: float | None = 10.0
    slots: SessionSlots = field(init=False)
    _parse: ActionParser | None = field(default=None, init=False)
    _warned: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.slots = SessionSlots(self.max_sessions)

    def __len__(self) -> int:
        return self.size

    def item(self, index: int) -> Item:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return Item(index=index, fields={"seed": self.first_seed + index})

    async def aclose(self) -> None:
        """Stop the server the worker started (the worker calls this when it stops)."""
        if self.server is not None:
            await self.server.stop()

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        seed = int(item.fields["seed"])
        url = await self._server_url()
        parse = await self._parser(url)
        self._warn_if_limited(group_size)
        shared: dict[str, Any] = {}
        first_lock = asyncio.Lock()

        async def episode(index: int) -> Completion:
            async with self._session(url, seed, group_size) as (session, first):
                shown = self.render(first.observation)
                async with first_lock:  # the first session to start renders the prompt
                    if not shared:
                        messages = self.runner.prompt_messages(shown)
                        shared.update(shown=shown, messages=messages, ids=await pool.tokenize(
                            messages=messages, add_generation_prompt=True))
                if shown != shared["shown"]:
                    raise ConfigError(
                        f"env {self.name!r}: two sessions reset with seed {seed} began with "
                        "different observations (does its reset ignore the seed?); a group "
                        "must start from one prompt")
                played = OpenEnvEpisode(session, first.observation, parse, self.render,
                                        self.invalid_action_reward)
                episode_sampling = sampling if sampling.seed is None else sampling.model_copy(
                    update={"seed": sampling.seed + index})
                async with session.kept_alive():
                    return await self.runner.run(played, pool, shared["ids"],
                                                 sampling=episode_sampling,
                                                 policy_version=policy_version)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(episode(index)) for index in range(group_size)]
        except ExceptionGroup as failed:  # a setting to fix stops the worker (exit 78)
            settings = [leaf for leaf in failed.exceptions if isinstance(leaf, ConfigError)]
            if settings:
                raise settings[0] from failed
            raise
        return Rollout(prompt_ids=shared["ids"], completions=[task.result() for task in tasks],
                       prompt_text=observation_text(shared["shown"]),
                       prompt_messages=shared["messages"], metadata={"seed": seed})

    @contextlib.asynccontextmanager
    async def _session(self, url: str, seed: int,
                       group_size: int) -> AsyncIterator[tuple[EnvSession, StepOutcome]]:
        """A reset session holding one of the worker's slots; closed on the way out."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.session_wait_s, 0.05
        while True:
            await self.slots.acquire()
            session: EnvSession | None = None
            try:
                session = await EnvSession.open(
                    url, connect_timeout_s=self.connect_timeout_s,
                    message_timeout_s=self.message_timeout_s, keepalive_s=self.keepalive_s)
                first = await session.reset(seed=seed, **self.reset_options)
                break
            except ServerFull as full:
                await self._let_go(session)
                if full.max_sessions is not None:
                    self.slots.learn(full.max_sessions)
                    self._warn_if_limited(group_size)
                if loop.time() + pause > deadline:
                    raise EnvServerUnavailable(
                        f"env server {url} had no free session within {self.session_wait_s:g} "
                        f"s ({full}): other clients hold its max_concurrent_envs "
                        f"{full.max_sessions} sessions") from full
                await asyncio.sleep(pause)  # other clients hold the slots: back off
                pause = min(2 * pause, 1.0)
            except BaseException:
                await self._let_go(session)
                raise
        try:
            yield session, first
        finally:
            await self._let_go(session)

    async def _let_go(self, session: EnvSession | None) -> None:
        try:
            if session is not None:
                await session.close()
        finally:
            self.slots.release()

    def _warn_if_limited(self, group_size: int) -> None:
        limit = self.slots.limit
        if limit is None or group_size <= limit or self._warned:
            return
        self._warned = True
        where = ("the max_concurrent_envs option (the env class must set "
                 "SUPPORTS_CONCURRENT_SESSIONS = True)" if self.server is not None else
                 "the server's create_app(..., max_concurrent_envs=N) (its env class must set "
                 "SUPPORTS_CONCURRENT_SESSIONS = True)")
        log.warning("openenv_sessions_limited", env=self.name, max_concurrent_envs=limit,
                    group_size=group_size,
                    detail=f"the server allows {limit} session(s) at once (its "
                           f"max_concurrent_envs), so a group's {group_size} episodes run "
                           f"{limit} at a time; raise it with {where}")

    async def _server_url(self) -> str:
        if self.server is None:
            assert self.url is not None
            return self.url
        url = await self.server.ensure_started()
        if self.server.max_sessions is not None and self.slots.limit is None:
            self.slots.learn(self.server.max_sessions)
        return url

    async def _parser(self, url: str) -> ActionParser:
        if self._parse is None:
            schema = await _schema(url) if self.action == "text" else None
            self._parse = action_parser(self.action, schema)
        return self._parse


async def _schema(url: str) -> dict[str, Any]:
    """The server's ``GET /schema`` (its action's JSON schema names the text field)."""
    try:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            response = await client.get(http_url(url) + "/schema")
            response.raise_for_status()
            found = response.json()
    except httpx.TransportError as exc:
        raise EnvServerUnavailable(f"env server {url} unreachable (GET /schema): "
                                   f"{type(exc).__name__}: {exc}") from exc
    except (httpx.HTTPError, ValueError) as exc:
        raise EnvServerUnavailable(f"env server {url}: GET /schema failed: {exc}") from exc
    if not isinstance(found, dict):
        raise EnvServerUnavailable(f"env server {url}: GET /schema answered {found!r}")
    return found


def openenv_env(spec: str, **options: Any) -> OpenEnvEnv:
    """``openenv:URL`` or ``openenv:MODULE[:APP]`` (module docstring)."""
    require("websockets", "openenv", "openenv")
    runner = bridge_runner(options)
    server_options = {key: options.pop(key) for key in _SERVER_OPTIONS if key in options}
    session = {key: options.pop(key, default) for key, default in _SESSION_OPTIONS.items()}
    env: dict[str, Any] = {
        "size": int(options.pop("size", 1000)),
        "first_seed": int(options.pop("first_seed", 0)),
        "reset_options": dict(options.pop("reset_options", {}) or {}),
        "action": str(options.pop("action", "text")),
        "render": renderer(options.pop("observation", None)),
        "invalid_action_reward": float(options.pop("invalid_action_reward", -1.0)),
        **session,
    }
    if options:
        raise ConfigError(f"env kind 'openenv': unknown options {sorted(options)}")
    if "seed" in env["reset_options"]:
        raise ConfigError("reset_options: the seed is the item's (first_seed + index)")
    if env["action"] not in ("text", "json") and not env["action"].startswith("text:"):
        action_parser(env["action"], None)  # a parser that cannot load fails at start-up
    name = f"openenv:{spec}"
    if _URL.match(spec):
        if server_options:
            raise ConfigError(f"{sorted(server_options)} apply to a server the worker starts "
                              f"(openenv:MODULE[:APP]), not to the running server {spec}")
        return OpenEnvEnv(name=name, url=spec, server=None, runner=runner, **env)
    if not _APP.match(spec):
        raise ConfigError(f"openenv:{spec}: give a server's URL (ws://HOST:PORT, "
                          "http://HOST:PORT) or an installed env package's app, MODULE[:APP]")
    python = str(server_options.get("python", sys.executable))
    if python == sys.executable and not _importable(spec.partition(":")[0]):
        raise ConfigError(f"openenv:{spec}: no module {spec.partition(':')[0]!r} in this "
                          "Python; install the env package, or name the Python of its own "
                          "environment with the python option")
    server = LocalEnvServer(
        app=spec, python=python,
        session_timeout_s=_number(server_options.get("session_timeout_s", 60.0)),
        max_concurrent_envs=_whole(server_options.get("max_concurrent_envs")),
        start_timeout_s=float(server_options.get("start_timeout_s", 120.0)))
    return OpenEnvEnv(name=name, url=None, server=server, runner=runner, **env)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _whole(value: Any) -> int | None:
    return None if value is None else int(value)
