"""Reading in a consumer group: new entries, own pending ones, reclaimed ones, and the
screening every delivery passes before anyone decodes it.

Delivery rules (DESIGN.md §3):

- A group is created at id 0, so a consumer group that attaches late still sees everything.
- ``read`` returns new entries; ``read_own_pending`` returns entries this consumer took but
  never acked (after a restart); ``recover_own_pending``, after a Redis outage, those of
  them the caller does not hold, without counting a delivery; ``reclaim`` takes over
  entries another consumer left pending longer than ``reclaim_idle_ms``.
- An entry delivered more than ``max_deliveries`` times is dead-lettered, not processed
  again, whether it comes back through reclaim or through ``read_own_pending`` (Redis
  counts both; the counts are read with XPENDING), so an entry that crashes its consumer
  cannot crash-loop it.
- No entry can crash a reader: one whose ``run`` field is not the run its stream key names
  is dead-lettered (``decode_error``) before anyone decodes it; with
  ``join_trajectories=True`` (the trainer's reader) each reference-form scored entry gets
  its trajectory merged in (``consumers.bus.join``), and one whose trajectory is gone or
  cannot be looked up is dead-lettered (``trajectory_missing``), never dropped.
- On a Redis Cluster a read never spans partitions (``_read_slots``).

The BUSYGROUP/NOGROUP replies are matched here and nowhere else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from rollq.consumers.bus.entries import (
    Delivery,
    as_text,
    id_order,
    is_cluster,
    run_of_stream,
    translated_errors,
)
from rollq.consumers.bus.join import join_trajectories
from rollq.consumers.bus.settle import EntrySettler
from rollq.consumers.bus.trimming import trim_streams
from rollq.schemas import DecodeError, Fields
from rollq.schemas.failures import MAX_DELIVERIES, TRAJECTORY_MISSING, classify


@dataclass(frozen=True)
class ReaderSettings:
    """How a consumer reads its streams."""

    block_ms: int = 2000
    """How long one XREADGROUP waits for new entries (milliseconds)."""
    count: int = 16
    """Most entries taken per read."""
    reclaim_idle_ms: int = 60_000
    """An entry pending this long (milliseconds) is presumed abandoned and taken over."""
    reclaim_every_s: float = 5.0
    """How often ``next_deliveries`` looks for abandoned entries (seconds)."""
    max_deliveries: int = 5
    """Deliveries after which an entry is dead-lettered instead of processed again."""
    max_backoff_s: float = 1.0
    """Longest sleep after empty reads (clients and fakes that do not honour BLOCK)."""
    slot_block_ms: int = 50
    """On a Redis Cluster: how long each round of per-partition blocking reads waits
    (milliseconds): the most a new entry waits while the reader blocks (see ``_read_slots``)."""


class StreamReader(EntrySettler):
    """A consumer in one consumer group over a run's partition streams."""

    def __init__(
        self,
        redis: aioredis.Redis,
        streams: Sequence[str],
        group: str,
        consumer: str,
        settings: ReaderSettings | None = None,
        *,
        join_trajectories: bool = False,
    ) -> None:
        if not streams:
            raise ValueError("a StreamReader needs at least one stream")
        super().__init__(redis, group)
        self.streams = list(streams)
        self.consumer = consumer
        self.settings = settings or ReaderSettings()
        self.join_trajectories = join_trajectories
        """Merge the traj entry each reference-form scored entry names (scored readers)."""
        self._runs = {stream: run_of_stream(stream) for stream in self.streams}
        self._empty_reads = 0
        self._last_reclaim = 0.0
        self._reclaim_cursor = dict.fromkeys(self.streams, "0-0")

    async def ensure_groups(self) -> None:
        """Create the consumer group on every stream at id 0 (idempotent)."""
        async with translated_errors("creating consumer groups"):
            for stream in self.streams:
                try:
                    await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
                except redis_errors.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """New entries for this consumer, waiting up to ``block_ms`` when there are none."""
        return await self._read_group(">", count, block_ms)

    async def read_own_pending(self, count: int | None = None) -> list[Delivery]:
        """Entries this consumer name was given earlier but never acked (after a restart),
        with their delivery counts; those delivered more than ``max_deliveries`` times
        (this re-read included) are dead-lettered instead (``max_deliveries``)."""
        return await self._read_group("0", count, None)

    async def recover_own_pending(self, held: Container[tuple[str, str]],
                                  count: int | None = None) -> list[Delivery]:
        """After a Redis outage: this consumer's pending entries that the caller does not
        hold (``held``: (stream, entry id) pairs), e.g. those of a read whose reply was lost.

        Unlike ``read_own_pending`` it does not deliver them again (XPENDING, then XRANGE),
        so an outage does not count as a delivery: the entries in the caller's hands are
        not pushed towards ``max_deliveries`` by every outage ridden out while they wait.
        Entries over ``max_deliveries`` are still dead-lettered.
        """
        count = count or self.settings.count
        deliveries: list[Delivery] = []
        async with translated_errors("recovering pending entries"):
            for stream in self.streams:
                rows = await self.redis.xpending_range(stream, self.group, min="-", max="+",
                                                       count=count, consumername=self.consumer)
                missing = {as_text(row["message_id"]): int(row["times_delivered"]) for row in rows
                           if (stream, as_text(row["message_id"])) not in held}
                if not missing:
                    continue
                pipe = self.redis.pipeline(transaction=False)
                for entry_id in missing:
                    pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
                for (entry_id, times), found in zip(missing.items(), await pipe.execute(),
                                                    strict=True):
                    if found:  # else its data was deleted: nothing to deliver
                        deliveries.append(Delivery(stream, entry_id, dict(found[0][1]), times))
        return await self._screened(deliveries)

    async def _read_group(self, start: str, count: int | None, block: int | None) -> list[Delivery]:
        count = count or self.settings.count
        if start == ">":
            block = self.settings.block_ms if block is None else block
        async with translated_errors("reading"):
            try:
                if is_cluster(self.redis) and len(self.streams) > 1:
                    reply = await self._read_slots(start, count, block or 0)
                else:
                    reply = await self.redis.xreadgroup(
                        self.group,
                        self.consumer,
                        dict.fromkeys(self.streams, start),
                        count=count,
                        block=block if block else None,
                    )
            except redis_errors.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_groups()  # the stream was deleted under us; recreate
                return []
        deliveries: list[Delivery] = []
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries = [(as_text(i), f) for i, f in entries if f is not None]  # None: data deleted
            counts: dict[str, int] = {}
            if start != ">" and entries:  # a re-read: Redis counted it, XPENDING says how often
                async with translated_errors("reading delivery counts"):
                    counts = await self._delivery_counts(name, [i for i, _ in entries])
            deliveries += [Delivery(name, i, f, counts.get(i, 1)) for i, f in entries]
        return await self._screened(deliveries)

    async def _read_slots(self, start: str, count: int, block_ms: int) -> list[Any]:
        """XREADGROUP on a Redis Cluster, where each partition's stream has a slot of its
        own and one command may not span slots.

        First one pipelined non-blocking read per partition (the cluster client sends each
        master its share at once: one round trip per master), ``ceil(count / partitions)``
        each; when that leaves the batch short and some partition had more, the rest is
        read from those partitions in turn. Only when every partition is empty do the
        reads block: all partitions at once, ``slot_block_ms`` at a time, until ``block_ms``
        is spent or entries come (a new entry waits at most ``slot_block_ms``). A read may
        return up to ``partitions - 1`` entries above ``count`` (the shares round up)."""
        share = -(-count // len(self.streams))
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xreadgroup(self.group, self.consumer, {stream: start}, count=share)
        reply: list[Any] = []
        full: list[str] = []
        for stream, found in zip(self.streams, await pipe.execute(), strict=True):
            reply += found or []
            if found and len(found[0][1]) >= share:
                full.append(stream)
        taken = sum(len(entries) for _, entries in reply)
        for stream in full:
            if taken >= count or start != ">":  # a re-read from "0" would repeat its entries
                break
            more = await self.redis.xreadgroup(self.group, self.consumer, {stream: start},
                                               count=count - taken)
            reply += more or []
            taken += sum(len(entries) for _, entries in more or [])
        if reply or not block_ms:
            return reply
        deadline = time.monotonic() + block_ms / 1000
        while not reply:
            wait_ms = int(min(self.settings.slot_block_ms, (deadline - time.monotonic()) * 1000))
            if wait_ms <= 0:
                break
            found_each = await asyncio.gather(*(
                self.redis.xreadgroup(self.group, self.consumer, {stream: start}, count=share,
                                      block=wait_ms) for stream in self.streams))
            reply = [item for found in found_each for item in found or []]
        return reply

    async def _screened(self, deliveries: list[Delivery]) -> list[Delivery]:
        """The deliveries that may be processed. Dead-lettered and left out: those delivered
        more than ``max_deliveries`` times, those whose ``run`` is not their stream's, and
        (with ``join_trajectories``, which gives the rest in inline form) those whose
        trajectory is gone or cannot be looked up."""
        kept: list[Delivery] = []
        for delivery in deliveries:
            why = self._refusal(delivery)
            if why is None:
                kept.append(delivery)
            else:
                await self.dead_letter(delivery, *why)
        if not self.join_trajectories or not kept:
            return kept
        joined = await join_trajectories(self.redis, [(d.stream, d.fields) for d in kept])
        usable: list[Delivery] = []
        for delivery, fields in zip(kept, joined, strict=True):
            if isinstance(fields, str):
                await self.dead_letter(delivery, TRAJECTORY_MISSING, fields)
            else:
                usable.append(replace(delivery, fields=fields))
        return usable

    def _refusal(self, delivery: Delivery) -> tuple[str, str] | None:
        """(reason, detail) when a delivery must not be processed, else None."""
        limit = self.settings.max_deliveries
        if delivery.deliveries > limit:
            return MAX_DELIVERIES, f"delivered {delivery.deliveries} times (max_deliveries={limit})"
        run = self._runs.get(delivery.stream)
        found = delivery.fields.get(b"run")
        if run is not None and found is not None and found != run.encode():
            failure = classify(DecodeError(
                f"field 'run' is {found[:80].decode(errors='replace')!r}, but the entry is in "
                f"a stream of run {run!r}"))
            return failure.reason, failure.detail
        return None

    async def reclaim(self, count: int | None = None) -> list[Delivery]:
        """Take over entries idle longer than ``reclaim_idle_ms``; dead-letter the over-delivered.

        Returns the reclaimed entries that may still be processed.
        """
        count = count or self.settings.count
        reclaimed: list[Delivery] = []
        for stream in self.streams:
            async with translated_errors("reclaiming"):
                reply = await self.redis.xautoclaim(
                    stream,
                    self.group,
                    self.consumer,
                    min_idle_time=self.settings.reclaim_idle_ms,
                    start_id=self._reclaim_cursor[stream],
                    count=count,
                )
                self._reclaim_cursor[stream] = as_text(reply[0])
                entries = [(as_text(i), f) for i, f in reply[1] if f is not None]
                if not entries:
                    continue
                counts = await self._delivery_counts(stream, [i for i, _ in entries])
            reclaimed += await self._screened(
                [Delivery(stream, i, f, counts.get(i, 1)) for i, f in entries])
        return reclaimed

    async def _delivery_counts(self, stream: str, entry_ids: list[str]) -> dict[str, int]:
        rows = await self.redis.xpending_range(
            stream,
            self.group,
            min=min(entry_ids, key=id_order),
            max=max(entry_ids, key=id_order),
            count=len(entry_ids) * 4 + 16,
            consumername=self.consumer,
        )
        return {as_text(row["message_id"]): int(row["times_delivered"]) for row in rows}

    async def next_deliveries(self, count: int | None = None) -> list[Delivery]:
        """The loop's one read: abandoned entries when due, else new ones.

        After an empty read it sleeps with exponential back-off, so a client that returns
        at once from BLOCK (fakeredis) does not spin.
        """
        now = time.monotonic()
        if now - self._last_reclaim >= self.settings.reclaim_every_s:
            self._last_reclaim = now
            reclaimed = await self.reclaim(count)
            if reclaimed:
                return reclaimed
        deliveries = await self.read(count)
        if deliveries:
            self._empty_reads = 0
        else:
            self._empty_reads += 1
            await asyncio.sleep(min(self.settings.max_backoff_s, 0.01 * 2**self._empty_reads))
        return deliveries

    async def fetch(self, stream: str, entry_id: str) -> Fields | None:
        """An entry's fields as they are stored (reference form), or None when it is gone:
        what a dead letter of an entry whose raw fields were not kept should carry."""
        async with translated_errors("fetching an entry"):
            found = await self.redis.xrange(stream, min=entry_id, max=entry_id, count=1)
        return dict(found[0][1]) if found else None

    async def trim(self, retention_ms: int | None = None) -> int:
        """``trim_streams`` over this reader's streams."""
        return await trim_streams(self.redis, self.streams, retention_ms)
