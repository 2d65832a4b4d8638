"""Posting a group (``/scored_data``, ``/scored_data_list``): from Atropos JSON to one XADD.

A posted group is encoded once (``ops.atropos.convert``) and written by one Lua script
(``_POST``) before the HTTP answer: to the partition's ``scored`` stream with its
``/batch`` piece stored beside it (``rewards="env"``, the env's scores), or to the
``traj`` stream (``rewards="bridge"``: rollq's scorers score it). With ``dedup_window_s``
the script also remembers the group's content digest (env, tokens, scores), so an
identical re-post in that window is answered without a second XADD; identical groups in
one ``/scored_data_list`` are distinct posts (their place among the identical ones is part
of the digest), so a retried list is recognised group by group. A group whose size
differs from its env's registered size is buffered (an RPUSH) until some buffered groups
sum to that size; those are XADDed and taken off the buffer in one MULTI/EXEC.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog

from rollq.consumers.bus import translated_errors
from rollq.ops.atropos.batching import groups_summing_to
from rollq.ops.atropos.convert import (
    InvalidGroup,
    mismatched_fields,
    scored_from_atropos,
    to_trajectory,
)
from rollq.ops.atropos.kept_pieces import PieceCache, build_piece, entry_text, piece_key
from rollq.ops.atropos.models import ScoredData
from rollq.ops.settings import RewardSource
from rollq.schemas import BrokerUnavailable, ContractError, encode
from rollq.schemas.keys import (
    POLICY_VERSION_FIELD,
    partition_of,
    partner_key,
    run_key,
    state_key,
    stream_key,
)

log = structlog.get_logger("rollq.atropos")

# XADD a group, store its /batch piece under the entry id, and (dedup on) remember its
# digest; a digest seen within the window answers nil and writes nothing.
# KEYS: stream, pieces hash, digest key. ARGV: piece ('' = none), window s ('0' = off),
# then the entry's field/value pairs.
_POST = """
if ARGV[2] ~= '0' and redis.call('EXISTS', KEYS[3]) == 1 then return false end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], id, ARGV[1]) end
if ARGV[2] ~= '0' then redis.call('SET', KEYS[3], id, 'EX', ARGV[2]) end
return id
"""


@dataclass(frozen=True)
class _Entry:
    """A posted group ready to XADD: its stream, fields, piece and content digest."""

    stream: str
    fields: dict[bytes, bytes]
    piece: bytes
    digest: str


def _digest(env: str, data: ScoredData, occurrence: int = 0) -> str:
    """What makes two posts the same group: the env, every sequence's tokens, the scores,
    and which of the identical groups of one request it is (``occurrence``)."""
    digest = hashlib.blake2b(env.encode(), digest_size=16)
    if occurrence:
        digest.update(b"occurrence:%d" % occurrence)
    try:
        for tokens in data.tokens:
            digest.update(len(tokens).to_bytes(4, "little"))
            digest.update(array.array("q", tokens).tobytes())
    except OverflowError:
        raise InvalidGroup("tokens hold an id outside 0..2147483647") from None
    digest.update(array.array("d", data.scores).tobytes())
    return digest.hexdigest()


class Poster:
    """Writes posted groups to one run's streams (or its per-env buffers).

    ``on_posted`` is called after any group was XADDed (the queue takes it in then);
    ``partitions`` is set by the store once the run's partition count is known.
    """

    def __init__(self, redis: aioredis.Redis, run: str, *, rewards: RewardSource,
                 partitions: int, gzip_level: int, dedup_window_s: int,
                 pieces_kept: PieceCache, on_posted: Callable[[], None]) -> None:
        self.redis = redis
        self.run = run
        self.rewards = rewards
        self.partitions = partitions
        self.gzip_level = gzip_level
        self.dedup_window_s = dedup_window_s
        self._pieces_kept = pieces_kept
        self._on_posted = on_posted
        self._post_script = redis.register_script(_POST)
        self._state = run_key(run, "atropos")

    def buffer_key(self, env_id: int) -> str:
        """The list of ``env_id``'s posted groups waiting to sum to its group size."""
        return run_key(self.run, f"atropos:buffer:{env_id}")

    async def post(self, data: ScoredData, envs: list[dict[str, Any]],
                   occurrence: int = 0) -> dict[str, Any]:
        """Store one posted group (or buffer it); the answer atroposlib gives.
        ``occurrence``: how many groups identical to it came before it in this request."""
        mismatched = mismatched_fields(data)
        if mismatched:
            log.warning("group_fields_set_aside", run=self.run, fields=mismatched,
                        detail="rows not one value a token: kept verbatim for /batch, "
                        "not used for rollq's own arrays")
        env_id = data.env_id
        if env_id is not None and 0 <= env_id < len(envs):
            expected = envs[env_id]["group_size"]
            if len(data.tokens) != expected:
                return await self._buffer(data, env_id, expected, envs)
        await self._publish([data], envs, occurrence)
        return {"status": "received"}

    def check(self, data: ScoredData) -> None:
        """Raise ``InvalidGroup`` for a group that could not be stored."""
        to_trajectory(data, run=self.run, env="check", group_id="check", policy_version=0)

    async def _publish(self, groups: Sequence[ScoredData], envs: list[dict[str, Any]],
                       occurrence: int = 0) -> None:
        entries = await self._entries(groups, envs, occurrence)
        async with translated_errors("posting a group"):
            pipe = self.redis.pipeline(transaction=True)
            for entry in entries:
                await self._queue_post(pipe, entry)
            ids = await pipe.execute()
        await self._posted(entries, ids)

    async def _queue_post(self, pipe: Any, entry: _Entry) -> None:
        args: list[bytes | str | int] = [entry.piece, self.dedup_window_s]
        for name, value in entry.fields.items():
            args += [name, value]
        await self._post_script(
            keys=[entry.stream, piece_key(entry.stream),
                  partner_key(entry.stream, f"atropos:posted:{entry.digest}")],
            args=args, client=pipe)

    async def _posted(self, entries: Sequence[_Entry], ids: Sequence[Any]) -> None:
        """Log re-posts answered without an XADD; remember the last group written."""
        last = None
        for entry, entry_id in zip(entries, ids, strict=True):
            if entry_id is None:
                log.info("group_repost_acknowledged", run=self.run, digest=entry.digest)
            else:
                last = (entry.stream, entry_id)
                if entry.piece:
                    self._pieces_kept.put((entry.stream, entry_text(entry_id)), entry.piece)
        if last is not None:
            self._on_posted()
            async with translated_errors("recording the latest group"):
                await self.redis.hset(self._state, "latest",
                                      f"{last[0]} {entry_text(last[1])}")

    async def _entries(self, groups: Sequence[ScoredData], envs: list[dict[str, Any]],
                       occurrence: int = 0) -> list[_Entry]:
        async with translated_errors("reading the policy version"):
            raw = await self.redis.hget(state_key(self.run), POLICY_VERSION_FIELD)
        version = int(raw or 0)
        # CPU-bound (JSON, deflate: zlib lets other requests run meanwhile)
        return await asyncio.to_thread(
            lambda: [self._encode(data, envs, version, occurrence) for data in groups])

    def _encode(self, data: ScoredData, envs: list[dict[str, Any]], version: int,
                occurrence: int) -> _Entry:
        env_id = data.env_id
        env = envs[env_id]["real_name"] if env_id is not None and 0 <= env_id < len(envs) \
            else "atropos"
        digest = _digest(env, data, occurrence)
        group_id = self._group_id(digest)
        trajectory = to_trajectory(data, run=self.run, env=env, group_id=group_id,
                                   policy_version=version)
        partition = partition_of(group_id, self.partitions)
        try:
            if self.rewards == "bridge":
                return _Entry(stream_key(self.run, partition, "traj"), encode(trajectory),
                              b"", digest)
            scored = scored_from_atropos(trajectory, data)
            return _Entry(stream_key(self.run, partition, "scored"), encode(scored),
                          build_piece(scored, self.gzip_level), digest)
        except (ContractError, ValueError) as exc:
            raise InvalidGroup(str(exc)) from None

    def _group_id(self, digest: str) -> str:
        """A fresh group id in the digest's partition (where the digest's key lives, so the
        check and the XADD are one single-slot script)."""
        target = partition_of(digest, self.partitions)
        while True:
            group_id = uuid.uuid4().hex
            if partition_of(group_id, self.partitions) == target:
                return group_id

    async def _buffer(self, data: ScoredData, env_id: int, expected: int,
                      envs: list[dict[str, Any]]) -> dict[str, Any]:
        self.check(data)  # a bad group is a 422 now, never a poison entry later
        key = self.buffer_key(env_id)
        blob = orjson.dumps(data.model_dump())
        while True:
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    items = [*await pipe.lrange(key, 0, -1), blob]
                    groups = [ScoredData.model_validate_json(item) for item in items]
                    chosen = groups_summing_to([len(g.tokens) for g in groups], expected)
                    entries = await self._entries([groups[i] for i in chosen], envs)
                    pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                    for entry in entries:
                        await self._queue_post(pipe, entry)
                    if chosen:
                        pipe.delete(key)
                        rest = [item for i, item in enumerate(items) if i not in chosen]
                        if rest:
                            pipe.rpush(key, *rest)
                    else:
                        pipe.rpush(key, blob)
                    replies = await pipe.execute()
                break
            except redis_errors.WatchError:
                continue
            except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
                raise BrokerUnavailable(f"redis unavailable while buffering: {exc}") from exc
        await self._posted(entries, replies[:len(entries)])
        remaining = sum(len(g.tokens) for i, g in enumerate(groups) if i not in chosen)
        return {"status": "buffered", "buffer_size": remaining}
