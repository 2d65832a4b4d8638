"""``SessionStore``: external agent sessions in Redis, so a gateway can die at any moment.

A session *group* (``group_size`` sessions of one prompt, a GRPO group) lives under its
partition's hash tag, beside the streams it ends on (``schemas.keys.session_key``):

    …:session:<group_id>:group      hash: env, group_size, row, defaults, policy_version,
                                    opened_at, closed (count), closed:<i> (session i's
                                    close: reward and metadata, JSON)
    …:session:<group_id>:calls:<i>  list: session i's captured calls, in the order they
                                    completed, each with the reply the agent got
    …:session:<group_id>:keys       hash: "<i>:<idempotency key>" -> position in calls:<i>
    …:session:<group_id>:claim:<i>:<key>
                                    a call in flight under that key (expires by itself)
    …:session:<group_id>:ended      what became of the group once it left (the traj entry
                                    id, or ``dead:<dead entry id>``), kept ``ended_ttl_s``
    …:sessions                      sorted set: open groups by last activity (epoch s)

Every change is one Lua script over keys of one slot, so it is atomic on a Redis Cluster
too: a call is recorded with its idempotency key and the group's activity; the last close
XADDs the group onto the traj stream and deletes the session keys in the same script (a
gateway killed before it leaves the session open, to be closed again; never half
published); an expiry XADDs the dead letter, counts ``drop:session_expired`` (freeing the
admission slot) and deletes the keys, only if the group is still idle.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import orjson
import redis.asyncio as aioredis

from rollq.producers.inference.capture import CapturedCall
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import DROP_PREFIX, counters_key, session_key, sessions_key, stream_key

# KEYS: group, index. ARGV: group id, now, field/value pairs. 1: opened; 0: already open;
# -1: the group ended already (its id is spent).
_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""
# KEYS: group, calls, keys, index, claim. ARGV: group id, session index, record, now,
# idempotency field ('' = none). The call's position; -1: the group is gone; -2: the
# session was closed while the call ran.
_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HEXISTS', KEYS[1], 'closed:' .. ARGV[2]) == 1 then return -2 end
local position = redis.call('RPUSH', KEYS[2], ARGV[3]) - 1
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], position) end
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('DEL', KEYS[5])
return position
"""
# KEYS: group, index. ARGV: group id, session index, close (JSON), now. Sessions closed so
# far (a repeated close changes nothing); -1: the group is gone; -2: no such session.
_CLOSE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if tonumber(ARGV[2]) >= tonumber(redis.call('HGET', KEYS[1], 'group_size')) then return -2 end
if redis.call('HSETNX', KEYS[1], 'closed:' .. ARGV[2], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'closed', 1)
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return tonumber(redis.call('HGET', KEYS[1], 'closed'))
"""
# KEYS: target stream, counters, index, ended, group, keys, calls:0..n-1. ARGV: group id,
# ended TTL s, idle cutoff ('' = none), drop reason ('' = a publish), ended prefix, then
# the entry's field/value pairs. The new entry id; false when the group is gone or (with a
# cutoff) was used since.
_END = """
if redis.call('EXISTS', KEYS[5]) == 0 then return false end
if ARGV[3] ~= '' then
  local seen = redis.call('ZSCORE', KEYS[3], ARGV[1])
  if seen and tonumber(seen) > tonumber(ARGV[3]) then return false end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 6))
if ARGV[4] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[4], 1) end
redis.call('SET', KEYS[4], ARGV[5] .. id, 'EX', ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', unpack(KEYS, 5))
return id
"""


@dataclass(frozen=True)
class StoredGroup:
    """An open session group as Redis holds it."""

    group_id: str
    env: str
    group_size: int
    row: dict[str, Any]
    """The prompt's dataset row (the group's metadata: what the scorers read)."""
    defaults: dict[str, Any]
    """Request fields every call of the group's sessions gets where the agent sent none."""
    policy_version: int
    """The policy version when the group was opened."""
    opened_at: float
    closes: dict[int, dict[str, Any]]
    """Closed sessions by index: ``{"reward": float | None, "metadata": {...}}``."""


@dataclass(frozen=True)
class StoredCall:
    """One captured call and the reply the agent got for it."""

    call: CapturedCall
    reply: dict[str, Any]


class SessionStore:
    """The Redis side of a run's session groups (module docstring)."""

    def __init__(self, redis: aioredis.Redis, run: str, *, ended_ttl_s: float = 86400.0) -> None:
        self.redis = redis
        self.run = run
        self.ended_ttl_s = ended_ttl_s
        self._open = redis.register_script(_OPEN)
        self._record = redis.register_script(_RECORD)
        self._close = redis.register_script(_CLOSE)
        self._end = redis.register_script(_END)

    def key(self, partition: int, group_id: str, part: str) -> str:
        return session_key(self.run, partition, group_id, part)

    async def open(self, partition: int, group: StoredGroup) -> int:
        """Store a new group: 1, or 0 when it is open already, -1 when it ended already."""
        fields: dict[str, Any] = {
            "env": group.env, "group_size": group.group_size, "row": orjson.dumps(group.row),
            "defaults": orjson.dumps(group.defaults), "policy_version": group.policy_version,
            "opened_at": repr(group.opened_at), "closed": 0}
        async with translated_errors("opening a session group"):
            return int(await self._open(
                keys=[self.key(partition, group.group_id, "group"),
                      sessions_key(self.run, partition),
                      self.key(partition, group.group_id, "ended")],
                args=[group.group_id, repr(group.opened_at),
                      *[item for pair in fields.items() for item in pair]]))

    async def group(self, partition: int, group_id: str) -> StoredGroup | None:
        async with translated_errors("reading a session group"):
            raw = await self.redis.hgetall(self.key(partition, group_id, "group"))
        if not raw:
            return None
        fields = {name.decode(): value for name, value in raw.items()}
        return StoredGroup(
            group_id=group_id, env=fields["env"].decode(),
            group_size=int(fields["group_size"]), row=orjson.loads(fields["row"]),
            defaults=orjson.loads(fields["defaults"]),
            policy_version=int(fields["policy_version"]),
            opened_at=float(fields["opened_at"]),
            closes={int(name.split(":", 1)[1]): orjson.loads(value)
                    for name, value in fields.items() if name.startswith("closed:")})

    async def ended(self, partition: int, group_id: str) -> str | None:
        """What became of a group that is no longer open (``ended`` key), if known."""
        async with translated_errors("reading a session group"):
            raw = await self.redis.get(self.key(partition, group_id, "ended"))
        return raw.decode() if raw is not None else None

    async def calls(self, partition: int, group_id: str, session: int) -> list[StoredCall]:
        """Session ``session``'s calls; each call's index is its position."""
        async with translated_errors("reading a session's calls"):
            raw = await self.redis.lrange(self.key(partition, group_id, f"calls:{session}"),
                                          0, -1)
        return [_decode_call(position, item) for position, item in enumerate(raw)]

    async def replay(self, partition: int, group_id: str, session: int,
                     idempotency_key: str) -> StoredCall | None:
        """The call recorded under ``idempotency_key``, if one was."""
        async with translated_errors("reading a session's calls"):
            position = await self.redis.hget(self.key(partition, group_id, "keys"),
                                              f"{session}:{idempotency_key}")
            if position is None:
                return None
            raw = await self.redis.lindex(
                self.key(partition, group_id, f"calls:{session}"), int(position))
        return None if raw is None else _decode_call(int(position), raw)

    async def claim(self, partition: int, group_id: str, session: int, idempotency_key: str,
                    ttl_s: float, *, renew: bool = False) -> bool:
        """Take the right to make the call under ``idempotency_key`` (False: a request
        with that key is in flight); lapses after ``ttl_s`` unless renewed (``renew``:
        extend a claim this request holds)."""
        key = self._claim_key(partition, group_id, session, idempotency_key)
        async with translated_errors("claiming a call"):
            if renew:
                return bool(await self.redis.pexpire(key, max(1, int(ttl_s * 1000))))
            return bool(await self.redis.set(key, b"1", nx=True, px=max(1, int(ttl_s * 1000))))

    async def release(self, partition: int, group_id: str, session: int,
                      idempotency_key: str) -> None:
        """Give a claim back (the call failed: a retry may make it)."""
        async with translated_errors("releasing a call"):
            await self.redis.delete(
                self._claim_key(partition, group_id, session, idempotency_key))

    def _claim_key(self, partition: int, group_id: str, session: int, key: str) -> str:
        return self.key(partition, group_id, f"claim:{session}:{key}")

    async def record(self, partition: int, group_id: str, session: int, call: CapturedCall,
                     reply: Mapping[str, Any], idempotency_key: str | None) -> int:
        """Append a call (module docstring): its position, -1 if the group is gone, -2 if
        the session was closed meanwhile."""
        record = orjson.dumps({"call": asdict(call), "reply": reply})
        async with translated_errors("recording a call"):
            return int(await self._record(
                keys=[self.key(partition, group_id, "group"),
                      self.key(partition, group_id, f"calls:{session}"),
                      self.key(partition, group_id, "keys"), sessions_key(self.run, partition),
                      self._claim_key(partition, group_id, session, idempotency_key or "")],
                args=[group_id, session, record, repr(time.time()), (
                    f"{session}:{idempotency_key}" if idempotency_key else "")]))

    async def close(self, partition: int, group_id: str, session: int,
                    close: Mapping[str, Any]) -> int:
        """Record session ``session``'s close: how many are closed, -1 if the group is gone,
        -2 if it has no session ``session``."""
        async with translated_errors("closing a session"):
            return int(await self._close(
                keys=[self.key(partition, group_id, "group"), sessions_key(self.run, partition)],
                args=[group_id, session, orjson.dumps(close), repr(time.time())]))

    async def publish(self, partition: int, group: StoredGroup,
                      fields: Mapping[bytes, bytes]) -> str | None:
        """XADD the group's entry to the traj stream and delete the session keys, once:
        the entry id, or None when the group had already ended."""
        return await self._finish(partition, group.group_id, group.group_size,
                                  stream_key(self.run, partition, "traj"), fields)

    async def dead_letter(self, partition: int, group_id: str, group_size: int,
                          fields: Mapping[bytes, bytes], reason: str, *,
                          idle_before: float | None = None) -> str | None:
        """XADD a dead letter, count ``drop:<reason>`` and delete the session keys, once;
        with ``idle_before``, only if the group's last activity is no later. The dead
        entry id, or None (ended already, or used since)."""
        return await self._finish(partition, group_id, group_size,
                                  stream_key(self.run, partition, "dead"), fields,
                                  reason=reason, idle_before=idle_before)

    async def _finish(self, partition: int, group_id: str, group_size: int, stream: str,
                      fields: Mapping[bytes, bytes], *, reason: str | None = None,
                      idle_before: float | None = None) -> str | None:
        keys = [stream, counters_key(self.run, partition), sessions_key(self.run, partition),
                self.key(partition, group_id, "ended"), self.key(partition, group_id, "group"),
                self.key(partition, group_id, "keys"),
                *[self.key(partition, group_id, f"calls:{i}") for i in range(group_size)]]
        args: list[Any] = [group_id, max(1, int(self.ended_ttl_s)),
                           "" if idle_before is None else repr(idle_before),
                           DROP_PREFIX + reason if reason else "",
                           "dead:" if reason else "",
                           *[item for pair in fields.items() for item in pair]]
        async with translated_errors("ending a session group"):
            entry_id = await self._end(keys=keys, args=args)
        if entry_id is None:
            return None
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def idle(self, partition: int, before: float) -> list[str]:
        """Open groups whose last activity is no later than ``before``."""
        async with translated_errors("listing idle session groups"):
            raw = await self.redis.zrangebyscore(sessions_key(self.run, partition), "-inf",
                                                 before)
        return [member.decode() for member in raw]


def _decode_call(position: int, raw: bytes) -> StoredCall:
    record = orjson.loads(raw)
    call = CapturedCall(**record["call"])
    return StoredCall(replace(call, index=position), record["reply"])
