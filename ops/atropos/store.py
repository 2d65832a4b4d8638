"""The Atropos API's state, all of it in Redis: any number of API processes serve one run.

Keys (run-wide ones under the run's hash tag, ``schemas.keys.run_key``):

    rollq:{<run>}:atropos           hash: registration (the trainer's, JSON), started, step,
                                    outstanding (the batch last handed out, JSON list of
                                    [stream, entry id]), redeliver, latest ("<stream> <id>")
    rollq:{<run>}:atropos:envs      list: registered envs (JSON), index = env_id
    rollq:{<run>}:atropos:buffer:<env_id>
                                    list: posted groups of a size other than their env's,
                                    verbatim JSON, until some of them sum to that size
    rollq:{<run>}:atropos:lock      the lock that serialises batch assembly across processes
    rollq:{<run>:<p>}:atropos:pieces
                                    hash: entry id -> the group's ``/batch`` JSON, deflated
                                    once (``ops.atropos.pieces``); HDEL when the group is
                                    acked or dropped
    rollq:{<run>:<p>}:atropos:posted:<digest>
                                    the entry id of a posted group, for ``dedup_window_s``:
                                    an identical re-post (same env, tokens and scores) in
                                    that window is answered without a second XADD

Delivery:

- A posted group is one XADD before the HTTP answer: to the partition's ``scored`` stream
  (``rewards="env"``, inline form, the env's scores) or ``traj`` stream
  (``rewards="bridge"``: rollq's scorers score it). With ``rewards="env"`` the same Lua
  script stores the group's ``/batch`` piece beside it; other groups (bridge-scored, or
  from rollq's own envs) get theirs built once when this API first reads them. A buffered
  group is an RPUSH; the groups that complete a size are XADDed and taken off the buffer
  in one MULTI/EXEC.
- ``/batch`` reads the scored streams in consumer group ``atropos`` as consumer ``queue``:
  the queue is that consumer's pending list (XPENDING) minus the batch last handed out. A
  handed-out batch stays pending until the next ``/batch`` (or ``/ack-batch``) acks it
  (counted ``consumed``); a ``/register`` in between (a restarted trainer) makes the next
  ``/batch`` hand the same batch out again, less any group acked meanwhile. So a crash of
  the trainer, of an API process or of Redis (AOF) loses no group, and no acked group is
  handed out again.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog

from consumers.bus import (
    Delivery,
    ReaderSettings,
    StreamReader,
    join_trajectories,
    translated_errors,
)
from ops.atropos.batching import Queued, env_status, groups_summing_to, select_batch
from ops.atropos.convert import InvalidGroup, to_atropos, to_scored, to_trajectory
from ops.atropos.models import ScoredData
from ops.atropos.pieces import compress, inflate
from ops.settings import RewardSource
from producers.publisher import Publisher
from schemas import (
    BrokerUnavailable,
    ContractError,
    DecodeError,
    ScoredGroup,
    decode_scored,
    encode,
)
from schemas.failures import TRAJECTORY_MISSING, classify
from schemas.keys import (
    CONSUMED_COUNTER,
    DROP_PREFIX,
    POLICY_VERSION_FIELD,
    counters_key,
    partition_of,
    partner_key,
    run_key,
    state_key,
    stream_key,
    stream_keys,
)

log = structlog.get_logger("rollq.atropos")

QUEUE_CONSUMER = "queue"
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
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
Ref = tuple[str, str]


@dataclass(frozen=True)
class _Entry:
    """A posted group ready to XADD: its stream, fields, piece and content digest."""

    stream: str
    fields: dict[bytes, bytes]
    piece: bytes
    digest: str


def _refs(raw: Any) -> list[Ref]:
    """Entry refs from their JSON form (a list of [stream, entry id])."""
    values = orjson.loads(raw) if isinstance(raw, str | bytes) else (raw or [])
    return [(str(stream), str(entry)) for stream, entry in values]


def _handed(state: dict[str, Any]) -> set[Ref]:
    """Groups out of the queue: the batch handed out and the batches formed ahead."""
    handed = set(_refs(state.get("outstanding")))
    for batch in orjson.loads(state.get("prepared", "[]")):
        handed.update(_refs(batch))
    return handed


def _digest(env: str, data: ScoredData) -> str:
    """What makes two posts the same group: the env, every sequence's tokens, the scores."""
    digest = hashlib.blake2b(env.encode(), digest_size=16)
    try:
        for tokens in data.tokens:
            digest.update(len(tokens).to_bytes(4, "little"))
            digest.update(array.array("q", tokens).tobytes())
    except OverflowError:
        raise InvalidGroup("tokens hold an id outside 0..2147483647") from None
    digest.update(array.array("d", data.scores).tobytes())
    return digest.hexdigest()


class NotRegistered(Exception):
    """``/batch`` before any trainer called ``/register``."""


class UnknownEnv(LookupError):
    """An ``env_id`` that no env registered."""


@dataclass
class _Held:
    group: ScoredGroup
    queued: Queued


def _piece_key(stream: str) -> str:
    return partner_key(stream, "atropos:pieces")


def _entry_text(entry: Any) -> str:
    return entry.decode() if isinstance(entry, bytes) else str(entry)


class _PieceCache:
    """This process's copies of recent pieces (the ones it posted or read), oldest
    dropped beyond ``budget`` bytes: a batch of groups posted here is joined without
    reading them back from Redis (Redis keeps the copy every process can read)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self._pieces: OrderedDict[Ref, bytes] = OrderedDict()

    def get(self, ref: Ref) -> bytes | None:
        return self._pieces.get(ref)

    def put(self, ref: Ref, piece: bytes) -> None:
        self.pop(ref)
        self._pieces[ref] = piece
        self.size += len(piece)
        while self.size > self.budget and self._pieces:
            self.size -= len(self._pieces.popitem(last=False)[1])

    def pop(self, ref: Ref) -> None:
        piece = self._pieces.pop(ref, None)
        if piece is not None:
            self.size -= len(piece)

    def clear(self) -> None:
        self._pieces.clear()
        self.size = 0


class AtroposStore:
    """One run's Atropos API state; ``async with AtroposStore(...)``."""

    def __init__(self, redis: aioredis.Redis, run: str, *, rewards: RewardSource = "env",
                 consumer_group: str = "atropos", partitions: int = 1,
                 lock_timeout_s: float = 30.0, cache_groups: int = 4096,
                 gzip_level: int = 1, dedup_window_s: int = 600,
                 piece_cache_bytes: int = 512 << 20) -> None:
        self.redis = redis
        self.run = run
        self.rewards = rewards
        self.consumer_group = consumer_group
        self.partitions = partitions
        self.lock_timeout_s = lock_timeout_s
        self.cache_groups = cache_groups
        self.gzip_level = gzip_level
        self.dedup_window_s = dedup_window_s
        self._post_script = redis.register_script(_POST)
        self._state = run_key(run, "atropos")
        self._envs = run_key(run, "atropos:envs")
        self._lock = run_key(run, "atropos:lock")
        self._cache: OrderedDict[Ref, _Held] = OrderedDict()
        self._pieces_kept = _PieceCache(piece_cache_bytes)
        self._reader: StreamReader | None = None
        self._ingester: asyncio.Task[None] | None = None
        self._posted_event = asyncio.Event()
        self._ingest_lock = asyncio.Lock()
        self._local_lock = asyncio.Lock()

    async def __aenter__(self) -> AtroposStore:
        self.partitions = await Publisher(self.redis, self.run, self.partitions).register()
        self._reader = StreamReader(
            self.redis, stream_keys(self.run, self.partitions, "scored"), self.consumer_group,
            QUEUE_CONSUMER, ReaderSettings(count=256), join_trajectories=True)
        await self._reader.ensure_groups()
        self._ingester = asyncio.create_task(self._ingest_posted())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ingester is not None:
            self._ingester.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ingester
        self._cache.clear()
        self._pieces_kept.clear()

    async def _ingest_posted(self) -> None:
        """Take posted groups into the consumer group as they arrive, between requests,
        so ``/batch`` finds them read and decoded. Best effort: a failure is logged and
        the next read (this loop's, or any request's) takes the groups instead."""
        while True:
            await self._posted_event.wait()
            self._posted_event.clear()
            try:
                await self._ingest()
            except Exception as exc:  # logged; the request path reads the groups anyway
                failure = classify(exc)
                log.warning("background_ingest_failed", run=self.run, reason=failure.reason,
                            detail=failure.detail)

    @property
    def reader(self) -> StreamReader:
        if self._reader is None:
            raise RuntimeError("AtroposStore used outside `async with`")
        return self._reader

    def _buffer_key(self, env_id: int) -> str:
        return run_key(self.run, f"atropos:buffer:{env_id}")

    # -- registration ------------------------------------------------------------------------

    async def state(self) -> dict[str, Any]:
        async with translated_errors("reading the Atropos API state"):
            raw = await self.redis.hgetall(self._state)
        state: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        if "registration" in state:
            state["registration"] = orjson.loads(state["registration"])
        return state

    async def envs(self) -> list[dict[str, Any]]:
        async with translated_errors("reading registered envs"):
            raw = await self.redis.lrange(self._envs, 0, -1)
        return [orjson.loads(item) for item in raw]

    async def register_trainer(self, registration: dict[str, Any]) -> int:
        """Record the first trainer's registration (later ones keep it, as atroposlib);
        a registration while a batch is out makes the next ``/batch`` hand it out again."""
        async with translated_errors("registering a trainer"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hsetnx(self._state, "registration", orjson.dumps(registration).decode())
            pipe.hsetnx(self._state, "step", str(registration["starting_step"]))
            pipe.hexists(self._state, "outstanding")
            _, _, outstanding = await pipe.execute()
            if outstanding:
                await self.redis.hset(self._state, "redeliver", "1")
        return uuid.uuid4().int

    async def register_env(self, env: dict[str, Any]) -> dict[str, Any] | None:
        """Append an env (under the lock: ids and names follow registration order); None
        while no trainer has started (called ``/batch``)."""
        async with self._locked():
            state = await self.state()
            if state.get("started") != "1":
                return None
            envs = await self.envs()
            same = sum(1 for e in envs if e["desired_name"] == env["desired_name"])
            record = {**env, "real_name": f"{env['desired_name']}_{same}",
                      "registered_id": len(envs), "last_update": time.time(),
                      "connected": True}
            async with translated_errors("registering an env"):
                await self.redis.rpush(self._envs, orjson.dumps(record))
        registration = state.get("registration", {})
        return {**record, "checkpoint_dir": registration.get("checkpoint_dir", ""),
                "starting_step": int(state.get("step", 0)),
                "checkpoint_interval": registration.get("save_checkpoint_interval", -1),
                "num_steps": registration.get("num_steps", -1)}

    async def disconnect_env(self, env_id: int) -> None:
        async with self._locked():
            envs = await self.envs()
            if not 0 <= env_id < len(envs):
                raise UnknownEnv("list index out of range")
            envs[env_id]["connected"] = False
            async with translated_errors("disconnecting an env"):
                await self.redis.lset(self._envs, env_id, orjson.dumps(envs[env_id]).decode())

    # -- posting -------------------------------------------------------------------------------

    async def post(self, data: ScoredData) -> dict[str, Any]:
        """Store one posted group (or buffer it); the answer atroposlib gives."""
        envs = await self.envs()
        env_id = data.env_id
        if env_id is not None and 0 <= env_id < len(envs):
            expected = envs[env_id]["group_size"]
            if len(data.tokens) != expected:
                return await self._buffer(data, env_id, expected, envs)
        await self._publish([data], envs)
        return {"status": "received"}

    async def _publish(self, groups: Sequence[ScoredData], envs: list[dict[str, Any]]) -> None:
        entries = await self._entries(groups, envs)
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
            keys=[entry.stream, _piece_key(entry.stream),
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
                    self._pieces_kept.put((entry.stream, _entry_text(entry_id)), entry.piece)
        if last is not None:
            self._posted_event.set()
            async with translated_errors("recording the latest group"):
                await self.redis.hset(self._state, "latest",
                                      f"{last[0]} {_entry_text(last[1])}")

    async def _entries(self, groups: Sequence[ScoredData],
                       envs: list[dict[str, Any]]) -> list[_Entry]:
        async with translated_errors("reading the policy version"):
            raw = await self.redis.hget(state_key(self.run), POLICY_VERSION_FIELD)
        version = int(raw or 0)
        # CPU-bound (JSON, deflate: zlib lets other requests run meanwhile)
        return await asyncio.to_thread(
            lambda: [self._encode(data, envs, version) for data in groups])

    def _encode(self, data: ScoredData, envs: list[dict[str, Any]], version: int) -> _Entry:
        env_id = data.env_id
        env = envs[env_id]["real_name"] if env_id is not None and 0 <= env_id < len(envs) \
            else "atropos"
        digest = _digest(env, data)
        group_id = self._group_id(digest)
        trajectory = to_trajectory(data, run=self.run, env=env, group_id=group_id,
                                   policy_version=version)
        partition = partition_of(group_id, self.partitions)
        try:
            if self.rewards == "bridge":
                return _Entry(stream_key(self.run, partition, "traj"), encode(trajectory),
                              b"", digest)
            scored = to_scored(trajectory, data)
            return _Entry(stream_key(self.run, partition, "scored"), encode(scored),
                          self._build_piece(scored), digest)
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

    def _build_piece(self, group: ScoredGroup) -> bytes:
        return compress(orjson.dumps(to_atropos(group), option=orjson.OPT_SERIALIZE_NUMPY),
                        self.gzip_level)

    def check(self, data: ScoredData) -> None:
        """Raise ``InvalidGroup`` for a group that could not be stored."""
        to_trajectory(data, run=self.run, env="check", group_id="check", policy_version=0)

    async def _buffer(self, data: ScoredData, env_id: int, expected: int,
                      envs: list[dict[str, Any]]) -> dict[str, Any]:
        self.check(data)  # a bad group is a 422 now, never a poison entry later
        key = self._buffer_key(env_id)
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

    # -- the queue -----------------------------------------------------------------------------

    async def _ingest(self) -> None:
        """Take every new scored entry into this API's consumer group (as pending)."""
        async with self._ingest_lock:  # one reader at a time: nothing decoded twice
            await self._ingest_new()

    async def _ingest_new(self) -> None:
        while True:
            deliveries = await self.reader.read(count=256, block_ms=0)
            held = {}
            for delivery in deliveries:
                if (group := await self._hold(delivery)) is not None:
                    held[(delivery.stream, delivery.entry_id)] = group
            await self._pieces(held)
            if len(deliveries) < 256:
                return

    async def _pieces(self, held: dict[Ref, _Held], *, load: bool = False) -> dict[Ref, bytes]:
        """Make sure every held group has its piece in Redis, building the missing ones
        (groups this API did not post); with ``load``, return them all."""
        kept = {ref: piece for ref in held if (piece := self._pieces_kept.get(ref)) is not None}
        refs = [ref for ref in held if ref not in kept]
        if not refs:
            return kept if load else {}
        async with translated_errors("reading batch pieces"):
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry in refs:
                if load:
                    pipe.hget(_piece_key(stream), entry)
                else:
                    pipe.hexists(_piece_key(stream), entry)
            replies = await pipe.execute()
        found = {ref: reply for ref, reply in zip(refs, replies, strict=True) if reply}
        missing = [ref for ref in refs if ref not in found]
        if missing:
            built = await asyncio.to_thread(
                lambda: {ref: self._build_piece(held[ref].group) for ref in missing})
            async with translated_errors("storing batch pieces"):
                pipe = self.redis.pipeline(transaction=False)
                for (stream, entry), piece in built.items():
                    pipe.hsetnx(_piece_key(stream), entry, piece)  # type: ignore[arg-type]  # bytes: stubs say str
                await pipe.execute()
            log.info("batch_pieces_built", run=self.run, groups=len(built))
            found.update(built)
            for ref, piece in built.items():
                self._pieces_kept.put(ref, piece)
        if not load:
            return {}
        for ref, piece in found.items():
            self._pieces_kept.put(ref, piece)
        return {**kept, **found}

    async def _hold(self, delivery: Delivery) -> _Held | None:
        ref = (delivery.stream, delivery.entry_id)
        try:
            group = decode_scored(delivery.fields)
        except DecodeError as exc:
            failure = classify(exc)
            await self.reader.dead_letter(delivery, failure.reason, failure.detail)
            log.warning("entry_dead_lettered", stream=delivery.stream,
                        entry_id=delivery.entry_id, reason=failure.reason,
                        detail=failure.detail)
            return None
        meta = group.trajectory.metadata.get("atropos")
        env_id = meta.get("env_id") if isinstance(meta, dict) else None
        held = _Held(group, Queued(len(group.scores), env_id))
        self._cache[ref] = held
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return held

    async def _pending(self) -> list[Ref]:
        refs: list[tuple[tuple[int, int], Ref]] = []
        async with translated_errors("listing the queue"):
            for stream in self.reader.streams:
                rows = await self.redis.xpending_range(
                    stream, self.consumer_group, min="-", max="+", count=1_000_000,
                    consumername=QUEUE_CONSUMER)
                for row in rows:
                    entry = row["message_id"]
                    entry = entry.decode() if isinstance(entry, bytes) else entry
                    ms, _, seq = entry.partition("-")
                    refs.append(((int(ms), int(seq)), (stream, entry)))
        refs.sort()
        return [ref for _, ref in refs]

    async def _fetch(self, refs: Sequence[Ref]) -> dict[Ref, _Held]:
        """Held groups by ref, from the cache or Redis; gone or undecodable ones left out."""
        found = {ref: self._cache[ref] for ref in refs if ref in self._cache}
        missing = [ref for ref in refs if ref not in found]
        if not missing:
            return found
        async with translated_errors("reading queued groups"):
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry in missing:
                pipe.xrange(stream, min=entry, max=entry, count=1)
            replies = await pipe.execute()
        present = [(ref, reply[0][1]) for ref, reply in zip(missing, replies, strict=True)
                   if reply]
        joined = await join_trajectories(self.redis, [(ref[0], f) for ref, f in present])
        for (ref, _), fields in zip(present, joined, strict=True):
            delivery = Delivery(ref[0], ref[1], fields if isinstance(fields, dict) else {})
            if isinstance(fields, str):
                await self.reader.dead_letter(delivery, TRAJECTORY_MISSING, fields)
                continue
            held = await self._hold(delivery)
            if held is not None:
                found[ref] = held
        return found

    async def queue(self, exclude: set[Ref] | None = None) -> list[tuple[Ref, _Held]]:
        """The groups waiting for a batch, oldest first."""
        await self._ingest()
        refs = [ref for ref in await self._pending() if ref not in (exclude or set())]
        held = await self._fetch(refs)
        return [(ref, held[ref]) for ref in refs if ref in held]

    async def queue_size(self) -> int:
        handed = _handed(await self.state())
        await self._ingest()
        return len([r for r in await self._pending() if r not in handed])

    # -- batches ---------------------------------------------------------------------------

    async def next_batch(self) -> list[bytes] | None:
        """The groups of the next batch as pieces (``ops.atropos.pieces``: each group's
        JSON, deflated), or None when none can be formed.

        As atroposlib, a call that finds no batch formed ahead forms every batch the queue
        allows, counts them all as steps, and hands out the last one formed first.
        Raises ``NotRegistered`` before the first ``/register``.
        """
        async with self._locked():
            state = await self.state()
            if "registration" not in state:
                raise NotRegistered
            if state.get("started") != "1":
                await self.redis.hset(self._state, "started", "1")
            outstanding = _refs(state.get("outstanding"))
            if outstanding:
                still = set(await self._pending())
                kept = [r for r in outstanding if r in still]
                if state.get("redeliver") == "1" and kept:
                    held = await self._fetch(kept)
                    await self.redis.hdel(self._state, "redeliver")
                    log.info("batch_redelivered", run=self.run, groups=len(kept))
                    pieces = await self._pieces(held, load=True)
                    return [pieces[r] for r in kept if r in pieces]
                await self._ack(kept)
            prepared = [_refs(batch) for batch in orjson.loads(state.get("prepared", "[]"))]
            formed = 0
            if not prepared:
                queue = await self.queue()
                envs = await self.envs()
                batch_size = state["registration"]["batch_size"]
                while (chosen := select_batch([h.queued for _, h in queue], batch_size,
                                              envs)) is not None:
                    prepared.append([queue[i][0] for i in chosen])
                    taken = set(chosen)
                    queue = [q for i, q in enumerate(queue) if i not in taken]
                formed = len(prepared)
            if not prepared:
                return None
            refs = prepared.pop()
            held = await self._fetch(refs)
            async with translated_errors("handing out a batch"):
                pipe = self.redis.pipeline(transaction=True)
                pipe.hset(self._state, mapping={"outstanding": orjson.dumps(refs),
                                                "prepared": orjson.dumps(prepared)})
                pipe.hdel(self._state, "redeliver")
                if formed:
                    pipe.hincrby(self._state, "step", formed)
                await pipe.execute()
            pieces = await self._pieces(held, load=True)
            log.info("batch_handed_out", run=self.run, groups=len(refs), formed=formed)
            return [pieces[r] for r in refs if r in pieces]

    async def ack_outstanding(self) -> int:
        """Ack the batch last handed out (``/ack-batch``); returns the groups acked now."""
        async with self._locked():
            state = await self.state()
            return await self._ack(_refs(state.get("outstanding")))

    async def _ack(self, refs: Sequence[Ref]) -> int:
        acked = await self.reader.ack_counted([Delivery(s, e, {}) for s, e in refs],
                                              CONSUMED_COUNTER) if refs else 0
        async with translated_errors("acking a batch"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hdel(self._state, "outstanding", "redeliver")
            for stream, entry in refs:
                pipe.hdel(_piece_key(stream), entry)
            await pipe.execute()
        for ref in refs:
            self._cache.pop(ref, None)
            self._pieces_kept.pop(ref)
        if refs:
            log.info("batch_acked", run=self.run, groups=len(refs), consumed=acked)
        return acked

    # -- status ----------------------------------------------------------------------------

    async def env_status(self, env_id: int) -> dict[str, Any]:
        async with self._locked():
            envs = await self.envs()
            if not 0 <= env_id < len(envs):
                raise UnknownEnv(f"env_id {env_id} is not registered ({len(envs)} envs are)")
            state = await self.state()
            queue = await self.queue(_handed(state))
            batch_size = state.get("registration", {}).get("batch_size", 0)
            status, group_size = env_status([h.queued for _, h in queue], env_id, envs,
                                            batch_size, int(state.get("step", 0)))
            if group_size != envs[env_id]["group_size"]:
                envs[env_id]["group_size"] = group_size
                async with translated_errors("updating an env"):
                    await self.redis.lset(self._envs, env_id, orjson.dumps(envs[env_id]).decode())
            return status

    async def latest(self) -> bytes | None:
        state = await self.state()
        stream, _, entry = state.get("latest", "").partition(" ")
        if not entry:
            return None
        held = await self._fetch([(stream, entry)])
        pieces = await self._pieces(held, load=True)
        return inflate(pieces[(stream, entry)]) if pieces else None

    async def reset(self) -> int:
        """atroposlib's ``/reset_data``: forget registrations and drop every queued and
        buffered group (counted ``drop:reset``). Returns the groups dropped."""
        async with self._locked():
            state = await self.state()
            queue = await self.queue()
            envs = await self.envs()
            dropped = await self.reader.drop([Delivery(s, e, {}) for (s, e), _ in queue],
                                             "reset") if queue else 0
            buffered = 0
            async with translated_errors("resetting"):
                pipe = self.redis.pipeline(transaction=True)
                for env_id in range(len(envs)):
                    pipe.llen(self._buffer_key(env_id))
                    pipe.delete(self._buffer_key(env_id))
                pipe.delete(self._state, self._envs,
                            *(_piece_key(stream) for stream in self.reader.streams))
                if "registration" in state:  # atroposlib's reset forgets all but this
                    pipe.hset(self._state, "max_token_len",
                              str(state["registration"]["max_token_len"]))
                replies = await pipe.execute()
                buffered = sum(replies[0:2 * len(envs):2])
                if buffered:
                    await self.redis.hincrby(counters_key(self.run, 0), DROP_PREFIX + "reset",
                                             buffered)
            self._cache.clear()
            self._pieces_kept.clear()
            log.info("atropos_reset", run=self.run, dropped=dropped, buffered=buffered)
            return dropped + buffered

    # -- the lock --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        token = uuid.uuid4().hex
        deadline = time.monotonic() + self.lock_timeout_s
        timeout_ms = int(self.lock_timeout_s * 1000)
        async with self._local_lock:
            pause = 0.001
            while True:
                async with translated_errors("taking the API lock"):
                    if await self.redis.set(self._lock, token, nx=True, px=timeout_ms):
                        break
                if time.monotonic() > deadline:
                    raise BrokerUnavailable("the Atropos API lock stayed taken for "
                                            f"{self.lock_timeout_s:.0f} s")
                await asyncio.sleep(pause)
                pause = min(0.05, pause * 2)
            try:
                yield
            finally:
                with contextlib.suppress(BrokerUnavailable, redis_errors.RedisError, OSError):
                    await self.redis.eval(_RELEASE, 1, self._lock, token)
