"""``SessionHost``: episodes opened over HTTP by agents that run outside rollq's workers.

A sandboxed coding agent, or a harness that owns its loop, cannot be an env of ``rollq
workers``; it opens its episodes on ``rollq gateway --sessions`` instead:

- **open** (``open``): one call opens a *group*: ``group_size`` sessions of one prompt
  (one sample each, a GRPO group), admitted under the run's staleness budget
  (``SessionGate``; refused with ``AdmissionRefused`` when it is spent). Each session has
  an id ``<group_id>.<i>`` and an OpenAI base URL of its own.
- **calls** (``call``): captured exactly as a worker's episode's calls are
  (``producers.inference.capture``: the server's own tokens, continuations spliced). The
  capture is rebuilt from Redis for every call, so any gateway process can serve any call
  and a restarted one continues where the killed one stopped. Each call is stored as it
  completes, with its reply. A call sent with an idempotency key (``Idempotency-Key``
  header) or its position in the session (``Rollq-Call-Index``) that was already captured
  is answered from the record, not generated again; a retry that arrives while the first
  try is still generating waits for it (the try's claim on the key is renewed while it
  runs, so one whose process was killed lapses within ``claim_ttl_s``).
- **close** (``close``): with a reward (the episode's ``env_score``) or without (the
  scorers' other components score it). When the last session of a group closes, the
  group is assembled like a worker's (``producers.envs.episode.build_rollout``: metadata
  is the row the open sent) and XADDed onto the traj stream, once, even if closes race or
  are retried. A group that cannot be assembled (a session made no model call) is
  dead-lettered ``contract_error``.
- **expiry** (``expire``): a group with no call and no close for ``session_ttl_s`` is
  dead-lettered ``session_expired`` (counted, freeing its slot), whichever process
  notices first; a later call or close on it is told so.

Every state change is written to Redis before it is answered (``SessionStore``).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog

from rollq.producers.envs.base import EpisodeResult, Item
from rollq.producers.envs.episode import build_rollout
from rollq.producers.inference.capture import (
    CapturedEpisode,
    CaptureStats,
    EpisodeCapture,
    EpisodeClosed,
    Upstream,
    assemble_sequences,
)
from rollq.producers.inference.capture.session import ContinuationCheck, PolicyVersionReader
from rollq.producers.sessions.gate import SessionGate
from rollq.producers.sessions.store import SessionStore, StoredCall, StoredGroup
from rollq.schemas import (
    ContractError,
    DeadLetter,
    TrajectoryGroup,
    TransientError,
    encode,
    encode_dead,
)
from rollq.schemas.failures import CONTRACT_ERROR, SESSION_EXPIRED
from rollq.schemas.keys import partition_of

log = structlog.get_logger("rollq.sessions")

GROUP_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SOURCE_PREFIX = "sessions:"
"""``source_stream`` of a session group's dead letter: ``sessions:<run>`` (not requeueable:
its agent must open a new group)."""


class SessionGone(EpisodeClosed):
    """No open session has this id: never opened, or its group was published or
    dead-lettered (the message says which)."""


class SessionConflict(ContractError):
    """A call the session's state refuses now (the gateway answers 409)."""


class SessionClosed(SessionConflict):
    """The session was closed: it takes no more calls."""


class CallInFlight(SessionConflict):
    """A call under the same idempotency key is still generating after ``call_timeout_s``."""


@dataclass(frozen=True)
class OpenedGroup:
    group_id: str
    session_ids: list[str]
    policy_version: int
    opened: bool
    """False: the group was open already (a retried open with the same ``group_id``)."""


@dataclass(frozen=True)
class CloseOutcome:
    session_id: str
    group_id: str
    closed: int | None
    """Sessions of the group closed so far (None: the group was published already)."""
    group_size: int | None
    entry_id: str | None = None
    """The group's traj entry, once the last session closed."""
    dead_letter: str | None = None
    """The group's dead letter entry, when it could not be published."""


@dataclass
class SessionCounts:
    """What this process did, for its metrics."""

    opened: int = 0
    refused: int = 0
    closed: int = 0
    published: int = 0
    expired: int = 0
    dead_lettered: int = 0
    replayed: int = 0
    """Calls answered from the record (an idempotency key seen before)."""


@dataclass
class SessionHost:
    """A run's external sessions (module docstring)."""

    store: SessionStore
    gate: SessionGate
    upstream: Upstream
    partitions: int
    policy_version: PolicyVersionReader
    session_ttl_s: float = 900.0
    call_timeout_s: float = 600.0
    """How long a retry waits for a try of the same call that is still generating."""
    claim_ttl_s: float = 10.0
    """A call in flight holds its idempotency key this long, renewed while it runs."""
    tool_parser: str | None = "hermes"
    continuation_check: ContinuationCheck = "before"
    counts: SessionCounts = field(default_factory=SessionCounts)

    @property
    def run(self) -> str:
        return self.store.run

    def _partition(self, group_id: str) -> int:
        return partition_of(group_id, self.partitions)

    # --- open ------------------------------------------------------------------------------

    async def open(self, env: str, *, group_size: int = 1,
                   row: Mapping[str, Any] | None = None,
                   defaults: Mapping[str, Any] | None = None,
                   group_id: str | None = None) -> OpenedGroup:
        """Admit and open a group of ``group_size`` sessions (``AdmissionRefused``)."""
        group_id = group_id or uuid.uuid4().hex
        if not GROUP_ID.match(group_id):
            raise ContractError(f"group_id {group_id!r} is invalid: use 1-64 characters from "
                                "A-Z a-z 0-9 _ -")
        if group_size < 1:
            raise ContractError("group_size must be at least 1")
        partition = self._partition(group_id)
        sessions = [f"{group_id}.{i}" for i in range(group_size)]
        existing = await self.store.group(partition, group_id)
        if existing is not None:  # a retried open: the same group, admitted once
            return OpenedGroup(group_id, [f"{group_id}.{i}" for i in range(existing.group_size)],
                               existing.policy_version, opened=False)
        version = await self.gate.admit_one()
        group = StoredGroup(group_id=group_id, env=env, group_size=group_size,
                            row=dict(row or {}), defaults=dict(defaults or {}),
                            policy_version=version, opened_at=time.time(), closes={})
        opened = await self.store.open(partition, group)
        if opened != 1:  # a racing open of the same group_id won: its slot is the one used
            await self.gate.give_back()
            if opened == 0:
                return OpenedGroup(group_id, sessions, version, opened=False)
            raise ContractError(f"group_id {group_id!r} was used by a group that ended")
        self.counts.opened += 1
        log.info("session_group_opened", group_id=group_id, env=env, group_size=group_size,
                 policy_version=version)
        return OpenedGroup(group_id, sessions, version, opened=True)

    # --- calls -----------------------------------------------------------------------------

    async def call(self, session_id: str, route: Literal["chat", "completions"],
                   body: Mapping[str, Any], *, idempotency_key: str | None = None,
                   call_index: int | None = None) -> dict[str, Any]:
        """Make and capture one call of a session; its reply body (module docstring).
        ``call_index``: the agent's count of its calls in this session (0 first): a call
        already captured at that position is answered from the record."""
        group_id, index, partition = self._parse(session_id)
        group = await self._open_group(partition, group_id, session_id)
        if index in group.closes:
            raise SessionClosed(f"session {session_id!r} is closed")
        if call_index is not None:
            earlier = await self.store.calls(partition, group_id, index)
            if call_index < len(earlier):
                return self._replay(group_id, index, earlier[call_index])
            if call_index > len(earlier):
                raise SessionConflict(f"call index {call_index} of session {session_id!r}: "
                                      f"only {len(earlier)} calls were captured")
            idempotency_key = idempotency_key or f"call-index:{call_index}"
        if idempotency_key is None:
            return await self._capture(session_id, group, partition, index, route, body, None)
        replayed = await self._replayed(partition, group_id, index, idempotency_key)
        if replayed is not None:
            return replayed
        holding = asyncio.create_task(self._hold(partition, group_id, index, idempotency_key))
        try:
            return await self._capture(session_id, group, partition, index, route, body,
                                       idempotency_key)
        except BaseException:
            await self.store.release(partition, group_id, index, idempotency_key)
            raise
        finally:
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)

    async def _capture(self, session_id: str, group: StoredGroup, partition: int, index: int,
                       route: Literal["chat", "completions"], body: Mapping[str, Any],
                       idempotency_key: str | None) -> dict[str, Any]:
        """The call itself: the capture rebuilt from the stored calls, then recorded."""
        earlier = await self.store.calls(partition, group.group_id, index)
        capture = EpisodeCapture(self.upstream, episode_id=session_id, defaults=group.defaults,
                                 policy_version=self.policy_version,
                                 tool_parser=self.tool_parser,
                                 continuation_check=self.continuation_check)
        capture.resume([stored.call for stored in earlier])
        reply = await (capture.chat(body) if route == "chat" else capture.complete(body))
        position = await self.store.record(partition, group.group_id, index,
                                           capture.calls[-1], reply, idempotency_key)
        if position == -2:
            raise SessionClosed(f"session {session_id!r} was closed while the call ran: "
                                "its reply was not captured")
        if position < 0:
            raise await self._gone(partition, group.group_id, session_id)
        return reply

    def _replay(self, group_id: str, index: int, stored: StoredCall) -> dict[str, Any]:
        self.counts.replayed += 1
        log.info("session_call_replayed", group_id=group_id, session=index,
                 call=stored.call.index)
        return stored.reply

    async def _replayed(self, partition: int, group_id: str, index: int,
                        key: str) -> dict[str, Any] | None:
        """The recorded reply under ``key``, waiting while another request holds the key
        (its try is generating); None once this request holds it (it makes the call)."""
        deadline = time.monotonic() + self.call_timeout_s
        while True:
            stored = await self.store.replay(partition, group_id, index, key)
            if stored is not None:
                return self._replay(group_id, index, stored)
            if await self.store.claim(partition, group_id, index, key, self.claim_ttl_s):
                return None
            if time.monotonic() > deadline:
                raise CallInFlight(f"a call with Idempotency-Key {key!r} is still in flight")
            await asyncio.sleep(0.05)

    async def _hold(self, partition: int, group_id: str, index: int, key: str) -> None:
        """Keep the key's claim while the call generates: a killed process's claim lapses
        within ``claim_ttl_s``, so a retry sent to another process goes ahead."""
        while True:
            await asyncio.sleep(self.claim_ttl_s / 3)
            try:
                await self.store.claim(partition, group_id, index, key, self.claim_ttl_s,
                                       renew=True)
            except TransientError as exc:  # the next renewal may reach Redis
                log.warning("session_claim_renewal_failed", group_id=group_id, error=str(exc))

    # --- close -----------------------------------------------------------------------------

    async def close(self, session_id: str, *, reward: float | None = None,
                    metadata: Mapping[str, Any] | None = None) -> CloseOutcome:
        """Close one session; the last close of a group publishes it (module docstring)."""
        group_id, index, partition = self._parse(session_id)
        closed = await self.store.close(partition, group_id, index,
                                        {"reward": reward, "metadata": dict(metadata or {})})
        if closed == -2:
            raise SessionGone(f"no session {session_id!r}: its group has fewer sessions")
        group = await self.store.group(partition, group_id) if closed >= 0 else None
        if closed >= 0:
            self.counts.closed += 1
        if group is None:  # it ended: published by another close (a retry), or dead
            ended = await self.store.ended(partition, group_id)
            if ended is not None and not ended.startswith("dead:"):
                return CloseOutcome(session_id, group_id, None, None, entry_id=ended)
            raise await self._gone(partition, group_id, session_id)
        if closed < group.group_size:
            return CloseOutcome(session_id, group_id, closed, group.group_size)
        return await self._publish(partition, group, session_id)

    async def _publish(self, partition: int, group: StoredGroup,
                       session_id: str) -> CloseOutcome:
        episodes = []
        for index in range(group.group_size):
            calls = await self.store.calls(partition, group.group_id, index)
            close = group.closes.get(index) or {}
            episodes.append((_episode(f"{group.group_id}.{index}", calls),
                             EpisodeResult(reward=close.get("reward"),
                                           metadata=close.get("metadata") or {})))
        outcome = CloseOutcome(session_id, group.group_id, group.group_size, group.group_size)
        try:
            rollout = build_rollout(episodes, Item(0, group.row))
        except ContractError as exc:
            letter = await self._dead_letter(partition, group, CONTRACT_ERROR, str(exc))
            return replace(outcome, dead_letter=letter)
        trajectory = TrajectoryGroup(
            group_id=group.group_id, run=self.run, env=group.env,
            policy_version=min([group.policy_version,
                                *(c.policy_version for c in rollout.completions)]),
            prompt_ids=rollout.prompt_ids, completions=tuple(rollout.completions),
            metadata=rollout.metadata, created_at=group.opened_at, finished_at=time.time())
        entry_id = await self.store.publish(partition, group, encode(trajectory))
        if entry_id is None:  # a racing close published it first
            entry_id = await self.store.ended(partition, group.group_id)
        else:
            self.counts.published += 1
            log.info("session_group_published", group_id=group.group_id, entry_id=entry_id,
                     tokens=trajectory.num_tokens, policy_version=trajectory.policy_version)
        return replace(outcome, entry_id=entry_id)

    # --- expiry ----------------------------------------------------------------------------

    async def expire(self, now: float | None = None) -> list[str]:
        """Dead-letter the groups idle for longer than ``session_ttl_s``; their ids."""
        cutoff = (time.time() if now is None else now) - self.session_ttl_s
        expired = []
        for partition in range(self.partitions):
            for group_id in await self.store.idle(partition, cutoff):
                group = await self.store.group(partition, group_id)
                if group is None:
                    continue
                open_sessions = [i for i in range(group.group_size) if i not in group.closes]
                detail = (f"session group {group_id} ({group.env}) had no call and no close for "
                          f"{self.session_ttl_s:g} s; sessions still open: "
                          f"{', '.join(f'{group_id}.{i}' for i in open_sessions)}")
                if await self._dead_letter(partition, group, SESSION_EXPIRED, detail,
                                           idle_before=cutoff):
                    self.counts.expired += 1
                    expired.append(group_id)
        return expired

    async def _dead_letter(self, partition: int, group: StoredGroup, reason: str, detail: str,
                           *, idle_before: float | None = None) -> str | None:
        letter = DeadLetter(reason=reason, detail=detail,
                            source_stream=SOURCE_PREFIX + self.run, source_id=group.group_id,
                            consumer_group="gateway", dead_at=time.time(), payload={})
        entry = await self.store.dead_letter(partition, group.group_id, group.group_size,
                                             encode_dead(letter), reason,
                                             idle_before=idle_before)
        if entry is not None:
            self.counts.dead_lettered += 1
            log.warning("session_group_dead_lettered", group_id=group.group_id, reason=reason,
                        detail=detail, entry_id=entry)
        return entry

    # --- helpers ---------------------------------------------------------------------------

    def _parse(self, session_id: str) -> tuple[str, int, int]:
        group_id, _, index = session_id.rpartition(".")
        if not GROUP_ID.match(group_id) or not index.isdigit():
            raise SessionGone(f"no session {session_id!r} (ids are <group_id>.<index>)")
        return group_id, int(index), self._partition(group_id)

    async def _open_group(self, partition: int, group_id: str,
                          session_id: str) -> StoredGroup:
        group = await self.store.group(partition, group_id)
        if group is None:
            raise await self._gone(partition, group_id, session_id)
        if int(session_id.rpartition(".")[2]) >= group.group_size:
            raise SessionGone(f"no session {session_id!r}: its group has {group.group_size}")
        return group

    async def _gone(self, partition: int, group_id: str, session_id: str) -> SessionGone:
        ended = await self.store.ended(partition, group_id)
        if ended is None:
            return SessionGone(f"no open session {session_id!r}")
        if ended.startswith("dead:"):
            return SessionGone(f"session {session_id!r}: its group was dead-lettered (entry "
                               f"{ended[5:]} of the dead stream; `rollq dead show`)")
        return SessionGone(f"session {session_id!r}: its group was published (traj entry "
                           f"{ended})")


def _episode(session_id: str, calls: list[StoredCall]) -> CapturedEpisode:
    """A stored session as the capture of one episode (its calls assembled)."""
    captured = [stored.call for stored in calls]
    stats = CaptureStats(calls=len(captured), token_in=sum(c.token_in for c in captured),
                         text_drift=sum(c.text_drift for c in captured),
                         # a call kept as the server made it though its text path drifted
                         chat_fallback=sum(c.text_drift and not c.token_in for c in captured))
    return CapturedEpisode(episode_id=session_id, sequences=assemble_sequences(captured),
                           stats=stats)
