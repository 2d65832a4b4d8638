"""The Atropos API's queue: the scored groups waiting for a ``/batch``, kept in Redis.

The queue is consumer ``queue``'s pending list (XPENDING) in the API's consumer group on
the run's scored streams, oldest first: a group enters it when any API process reads it
(``ingest``, also run in the background as groups are posted) and leaves it when the
store acks or drops it. Decoded groups are cached in this process (``cache_groups``),
and every queued group's ``/batch`` piece is made sure of in Redis
(``ops.atropos.kept_pieces``), built here for groups this API did not post. An entry that
does not decode, or whose trajectory is gone, is dead-lettered with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import (
    Delivery,
    ReaderSettings,
    StreamReader,
    join_trajectories,
    translated_errors,
)
from rollq.ops.atropos.batching import Queued
from rollq.ops.atropos.kept_pieces import PieceCache, Ref, build_piece, piece_key
from rollq.schemas import DecodeError, ScoredGroup, decode_scored
from rollq.schemas.failures import TRAJECTORY_MISSING, classify
from rollq.schemas.keys import stream_keys

log = structlog.get_logger("rollq.atropos")

QUEUE_CONSUMER = "queue"


@dataclass
class QueuedGroup:
    """A queued group, decoded, with what the batch rules need of it."""

    group: ScoredGroup
    queued: Queued


class Queue:
    """One run's queue for one API process; ``start`` it, ``close`` it."""

    def __init__(self, redis: aioredis.Redis, run: str, *, consumer_group: str,
                 cache_groups: int, gzip_level: int, pieces_kept: PieceCache) -> None:
        self.redis = redis
        self.run = run
        self.consumer_group = consumer_group
        self.cache_groups = cache_groups
        self.gzip_level = gzip_level
        self._cache: OrderedDict[Ref, QueuedGroup] = OrderedDict()
        self._pieces_kept = pieces_kept
        self._reader: StreamReader | None = None
        self._ingester: asyncio.Task[None] | None = None
        self._posted_event = asyncio.Event()
        self._ingest_lock = asyncio.Lock()

    async def start(self, partitions: int) -> None:
        """Read the run's ``partitions`` scored streams; take posted groups in as they come."""
        self._reader = StreamReader(
            self.redis, stream_keys(self.run, partitions, "scored"), self.consumer_group,
            QUEUE_CONSUMER, ReaderSettings(count=256), join_trajectories=True)
        await self._reader.ensure_groups()
        self._ingester = asyncio.create_task(self._ingest_posted())

    async def close(self) -> None:
        if self._ingester is not None:
            self._ingester.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ingester
        self.clear()

    @property
    def reader(self) -> StreamReader:
        if self._reader is None:
            raise RuntimeError("AtroposStore used outside `async with`")
        return self._reader

    def posted(self) -> None:
        """Groups were posted: the background ingest takes them in."""
        self._posted_event.set()

    def forget(self, refs: Sequence[Ref]) -> None:
        """Drop acked groups from this process's caches."""
        for ref in refs:
            self._cache.pop(ref, None)
            self._pieces_kept.pop(ref)

    def clear(self) -> None:
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
                await self.ingest()
            except Exception as exc:  # logged; the request path reads the groups anyway
                failure = classify(exc)
                log.warning("background_ingest_failed", run=self.run, reason=failure.reason,
                            detail=failure.detail)

    async def ingest(self) -> None:
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
            await self.pieces(held)
            if len(deliveries) < 256:
                return

    async def pieces(self, held: dict[Ref, QueuedGroup], *, load: bool = False) -> dict[Ref, bytes]:
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
                    pipe.hget(piece_key(stream), entry)
                else:
                    pipe.hexists(piece_key(stream), entry)
            replies = await pipe.execute()
        found = {ref: reply for ref, reply in zip(refs, replies, strict=True) if reply}
        missing = [ref for ref in refs if ref not in found]
        if missing:
            built = await asyncio.to_thread(
                lambda: {ref: build_piece(held[ref].group, self.gzip_level) for ref in missing})
            async with translated_errors("storing batch pieces"):
                pipe = self.redis.pipeline(transaction=False)
                for (stream, entry), piece in built.items():
                    pipe.hsetnx(piece_key(stream), entry, piece)  # type: ignore[arg-type]  # bytes: stubs say str
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

    async def _hold(self, delivery: Delivery) -> QueuedGroup | None:
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
        held = QueuedGroup(group, Queued(len(group.scores), env_id))
        self._cache[ref] = held
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return held

    async def pending(self) -> list[Ref]:
        """Every group in the queue (handed out or not), oldest first."""
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

    async def fetch(self, refs: Sequence[Ref]) -> dict[Ref, QueuedGroup]:
        """QueuedGroup groups by ref, from the cache or Redis; gone or undecodable ones left out."""
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

    async def waiting(self, exclude: set[Ref] | None = None) -> list[tuple[Ref, QueuedGroup]]:
        """The groups waiting for a batch, oldest first."""
        await self.ingest()
        refs = [ref for ref in await self.pending() if ref not in (exclude or set())]
        held = await self.fetch(refs)
        return [(ref, held[ref]) for ref in refs if ref in held]
