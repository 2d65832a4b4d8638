"""The consumer-group verbs: the one owner of XREADGROUP, XACK, XAUTOCLAIM, XPENDING,
dead-lettering, the exactly-once forward script and safe trimming.

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
  is dead-lettered (``decode_error``) before anyone decodes it; a scored entry naming a
  traj entry by an id Redis cannot hold, or whose lookup fails, is dead-lettered
  (``trajectory_missing``) with the reason in the detail.
- ``forward`` is exactly-once: in one MULTI/EXEC it XADDs the new entries and then runs a
  small script that XACKs their source entries; XACK returns 1 only to the first acker, and
  for each XACK that returns 0 the script deletes that entry's copy just added. EXEC is
  atomic, so no reader ever sees such a copy: of two consumers racing on a reclaimed entry
  exactly one forwards it. ``forward_many`` runs one script per source stream, not one per
  entry. The payload stays out of Lua on purpose: a dead letter carries a whole group, and
  copying a 0.5 MB group into script arguments cost Redis 7.0 three times the CPU of the
  XADD itself (measured with bench/bus.py's groups).
- A scored entry names its trajectory's traj entry instead of copying it (see
  ``schemas.codec``); a reader made with ``join_trajectories=True`` (the trainer's) merges
  that entry in before handing deliveries out, one pipelined XRANGE per batch. An entry
  whose trajectory is gone is dead-lettered as ``trajectory_missing``, never dropped.
  ``trim_streams`` keeps every traj entry that a scored entry not yet consumed names.
- ``dead_letter``, ``drop`` and ``ack_counted`` run one script (per stream) that acks and
  counts only the entries this call acked first (and, for dead letters, adds the letter).
  Every count is exact.

Redis errors are translated here: connection problems become ``BrokerUnavailable``; the
BUSYGROUP/NOGROUP/NOSCRIPT replies are matched in this module and nowhere else.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from schemas import (
    BrokerUnavailable,
    DeadLetter,
    DecodeError,
    Fields,
    encode_dead,
    join_trajectory,
    trajectory_ref,
)
from schemas.failures import MAX_DELIVERIES, TRAJECTORY_MISSING, classify
from schemas.keys import DROP_PREFIX, PREFIX, partner_key

T = TypeVar("T")
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")  # ASCII digits: \d takes any script's
_MAX_ID_PART = 2**64 - 1  # a stream id is two unsigned 64-bit numbers, ms-seq
_STREAM_RUN = re.compile(re.escape(PREFIX) + r":\{([A-Za-z0-9_.\-]+):[0-9]+\}:")

# KEYS[1] source stream, KEYS[2] counters hash; ARGV[1] group, ARGV[2] counter field ('' for
# none), ARGV[3..] entry ids. Acks them; counts only those this call's XACK acked first.
_ACK_AND_COUNT = """
local acked = 0
for i = 3, #ARGV do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
end
if acked > 0 and ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], acked) end
return acked
"""

# Runs inside MULTI right after the caller XADDed one copy per id to KEYS[2], in ARGV
# order, so those copies are the stream's last entries. KEYS[1] source stream, KEYS[3]
# counters hash; ARGV[1] group, ARGV[2] counter field ('' for none), ARGV[3..] source ids.
# Returns 1 per id this call acked first, else 0 — and then deletes that id's copy: EXEC
# is atomic, so no reader can have seen it. Ranges only when some id lost (rare), as
# XREVRANGE copies the payloads into Lua.
_ACK_OR_UNDO = """
local n = #ARGV - 2
local won = {}
local acked = 0
for i = 1, n do
  won[i] = redis.call('XACK', KEYS[1], ARGV[1], ARGV[i + 2])
  acked = acked + won[i]
end
if acked > 0 and ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[2], acked) end
if acked < n then
  local added = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', n)
  for i = 1, n do
    if won[i] == 0 then redis.call('XDEL', KEYS[2], added[n + 1 - i][1]) end
  end
end
return won
"""

# KEYS[1] stream; ARGV[1] retention floor id ('' for none). Trims below the oldest entry some
# consumer group still needs: its oldest pending entry, or the first one it has not read.
# Without consumer groups nothing is trimmed: nobody has consumed anything yet.
# KEYS[2], when given, is a stream whose entries name entries of KEYS[1] in field 'traj'
# (the partition's scored stream): every entry named by one that some group of KEYS[2] has
# not consumed (all of them, before KEYS[2] has a group) is kept, and with a retention
# floor so is the trajectory of the oldest scored entry still retained (trainer replay).
_SAFE_TRIM = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if ms == nil then return nil end
  return {tonumber(ms), tonumber(seq)}
end
local function less(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end
local function needed(key)
  if redis.call('EXISTS', key) == 0 then return nil end
  local floor = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    local last = parse(info['last-delivered-id'])
    local candidate = {last[1], last[2] + 1}
    if info['pending'] > 0 then
      local oldest = parse(redis.call('XPENDING', key, info['name'])[2])
      if less(oldest, candidate) then candidate = oldest end
    end
    if floor == nil or less(candidate, floor) then floor = candidate end
  end
  return floor
end
local function ref(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'traj' then return parse(fields[i + 1]) end
  end
  return nil
end
local floor = needed(KEYS[1])
if floor == nil then return 0 end
if ARGV[1] ~= '' then
  local retention = parse(ARGV[1])
  if less(retention, floor) then floor = retention end
end
if #KEYS > 1 then
  local unconsumed = needed(KEYS[2])
  local from = '-'
  if unconsumed ~= nil then from = unconsumed[1] .. '-' .. unconsumed[2] end
  local entries = redis.call('XRANGE', KEYS[2], from, '+')
  if ARGV[1] ~= '' then
    local kept = redis.call('XRANGE', KEYS[2], ARGV[1], '+', 'COUNT', 1)
    if #kept > 0 then table.insert(entries, kept[1]) end
  end
  for _, entry in ipairs(entries) do
    local named = ref(entry[2])
    if named ~= nil and less(named, floor) then floor = named end
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', floor[1] .. '-' .. floor[2])
"""


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


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this consumer."""

    stream: str
    entry_id: str
    fields: Fields
    deliveries: int = 1
    """Times the entry has been delivered, this delivery included."""


@asynccontextmanager
async def translated_errors(action: str) -> AsyncIterator[None]:
    """Turn redis-py connection failures into ``BrokerUnavailable``."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise BrokerUnavailable(f"redis unavailable while {action}: {exc}") from exc


class StreamReader:
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
        self.redis = redis
        self.streams = list(streams)
        self.group = group
        self.consumer = consumer
        self.settings = settings or ReaderSettings()
        self.join_trajectories = join_trajectories
        """Merge the traj entry each reference-form scored entry names (scored readers)."""
        self._ack_and_count = redis.register_script(_ACK_AND_COUNT)
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
                missing = {_id(row["message_id"]): int(row["times_delivered"]) for row in rows
                           if (stream, _id(row["message_id"])) not in held}
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
            entries = [(_id(i), f) for i, f in entries if f is not None]  # None: data deleted
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
                self._reclaim_cursor[stream] = _id(reply[0])
                entries = [(_id(i), f) for i, f in reply[1] if f is not None]
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
            min=min(entry_ids, key=_id_key),
            max=max(entry_ids, key=_id_key),
            count=len(entry_ids) * 4 + 16,
            consumername=self.consumer,
        )
        return {_id(row["message_id"]): int(row["times_delivered"]) for row in rows}

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

    async def ack(self, deliveries: Sequence[Delivery]) -> int:
        """Acknowledge entries; returns how many were still pending."""
        acked = 0
        async with translated_errors("acking"):
            for stream in {d.stream for d in deliveries}:
                ids = [d.entry_id for d in deliveries if d.stream == stream]
                acked += int(await self.redis.xack(stream, self.group, *ids))
        return acked

    async def forward(
        self, delivery: Delivery, destination: str, fields: Fields, counter: str = ""
    ) -> str | None:
        """Ack ``delivery`` and XADD ``fields`` to the ``destination`` stream of the same
        partition, atomically and only if this call's XACK was the first. Returns the new
        entry id, or None when another consumer had already acked (and forwarded) it."""
        results = await self.forward_many([(delivery, fields)], destination, counter)
        return results[0]

    async def forward_many(
        self, items: Sequence[tuple[Delivery, Fields]], destination: str, counter: str = ""
    ) -> list[str | None]:
        """``forward`` for several entries in one round trip (one MULTI/EXEC)."""
        if not items:
            return []
        by_stream: dict[str, list[int]] = {}
        for index, (delivery, _) in enumerate(items):
            by_stream.setdefault(delivery.stream, []).append(index)
        # One MULTI for all partitions on one server; on a cluster one per partition (a
        # transaction keeps to one slot), all at once.
        batches = ([by_stream] if not is_cluster(self.redis)
                   else [{stream: indices} for stream, indices in by_stream.items()])
        async with translated_errors("forwarding"):
            replies = [reply for replies in await asyncio.gather(*(
                self._forward_transaction(items, batch, destination, counter)
                for batch in batches)) for reply in replies]
        results: list[str | None] = [None] * len(items)
        position = 0
        for indices in by_stream.values():
            won = replies[position + len(indices)]
            for offset, index in enumerate(indices):
                if won[offset] == 1:
                    results[index] = _id(replies[position + offset])
            position += len(indices) + 1
        return results

    async def _forward_transaction(self, items: Sequence[tuple[Delivery, Fields]],
                                   by_stream: dict[str, list[int]], destination: str,
                                   counter: str) -> list[Any]:
        pipe = self.redis.pipeline(transaction=True)
        for stream, indices in by_stream.items():
            target = partner_key(stream, destination)
            for index in indices:
                pipe.xadd(target, items[index][1])  # type: ignore[arg-type]
            # EVAL, not EVALSHA: a NOSCRIPT error inside MULTI would leave the copies
            # added, and checking with SCRIPT EXISTS first costs a round trip per call.
            pipe.eval(_ACK_OR_UNDO, 3, stream, target, partner_key(stream, "counters"),
                      self.group, counter, *(items[i][0].entry_id for i in indices))
        return list(await pipe.execute())

    async def drop(self, deliveries: Sequence[Delivery], reason: str) -> int:
        """Ack entries that will not be used and count them under ``drop:<reason>``."""
        return await self.ack_counted(deliveries, DROP_PREFIX + reason)

    async def ack_counted(self, deliveries: Sequence[Delivery], counter: str) -> int:
        """Ack entries and count the ones this call acked first under ``counter``."""
        by_stream: dict[str, list[str]] = {}
        for d in deliveries:
            by_stream.setdefault(d.stream, []).append(d.entry_id)
        if not by_stream:
            return 0
        async with translated_errors("acking"):
            if len(by_stream) == 1:
                [(stream, ids)] = by_stream.items()
                return int(await self._ack_and_count(keys=[stream, partner_key(stream, "counters")],
                                                     args=[self.group, counter, *ids]))
            # EVAL in the pipeline: a registered script would add a SCRIPT EXISTS round trip.
            pipe = self.redis.pipeline(transaction=False)
            for stream, ids in by_stream.items():
                pipe.eval(_ACK_AND_COUNT, 2, stream, partner_key(stream, "counters"),
                          self.group, counter, *ids)
            return sum(int(r) for r in await pipe.execute())

    async def fetch(self, stream: str, entry_id: str) -> Fields | None:
        """An entry's fields as they are stored (reference form), or None when it is gone:
        what a dead letter of an entry whose raw fields were not kept should carry."""
        async with translated_errors("fetching an entry"):
            found = await self.redis.xrange(stream, min=entry_id, max=entry_id, count=1)
        return dict(found[0][1]) if found else None

    async def dead_letter(self, delivery: Delivery, reason: str, detail: str = "") -> bool:
        """Move an entry to the partition's dead stream with the reason and its payload."""
        letter = DeadLetter(
            reason=reason,
            detail=detail,
            source_stream=delivery.stream,
            source_id=delivery.entry_id,
            consumer_group=self.group,
            deliveries=delivery.deliveries,
            dead_at=time.time(),
            payload=dict(delivery.fields),
        )
        new_id = await self.forward(delivery, "dead", encode_dead(letter), DROP_PREFIX + reason)
        return new_id is not None

    async def trim(self, retention_ms: int | None = None) -> int:
        """``trim_streams`` over this reader's streams."""
        return await trim_streams(self.redis, self.streams, retention_ms)


async def trim_streams(redis: aioredis.Redis, streams: Sequence[str],
                       retention_ms: int | None = None) -> int:
    """Trim streams below the oldest entry some consumer group still needs.

    Safe from any process: each group's floor is its oldest pending or first unread entry,
    read in the same script as the XTRIM. ``retention_ms`` also keeps acknowledged entries
    younger than that, for replay (rescore, trainer resume). A stream without consumer
    groups is left alone. Returns the number of entries removed.
    """
    floor = ""
    if retention_ms is not None:
        floor = f"{max(0, int(time.time() * 1000) - retention_ms)}-0"
    removed = 0
    async with translated_errors("trimming"):
        for stream in streams:
            keys = [stream]
            if stream.endswith(":traj"):  # scored entries name traj entries: keep those
                keys.append(partner_key(stream, "scored"))
            removed += int(await redis.eval(_SAFE_TRIM, len(keys), *keys, floor))
    return removed


async def join_trajectories(redis: aioredis.Redis,
                            entries: Sequence[tuple[str, Fields]]) -> list[Fields | str]:
    """The inline form of each (scored stream, fields) entry: a reference-form entry gets
    the traj entry it names merged in (one pipelined XRANGE for all); other entries come
    back unchanged. Where the named entry is gone or holds another group, the reason why
    comes back instead of fields."""
    out: list[Fields | str] = [fields for _, fields in entries]
    refs: list[tuple[int, str, str]] = []  # (index, traj stream, entry id)
    for i, (stream, fields) in enumerate(entries):
        ref = trajectory_ref(fields)
        if ref is None:
            continue
        if is_entry_id(ref):
            refs.append((i, partner_key(stream, "traj"), ref))
        else:
            out[i] = (f"field 'traj' is not a stream entry id (two unsigned 64-bit numbers, "
                      f"ms-seq): {ref[:40]!r}")
    if not refs:
        return out
    async with translated_errors("reading trajectories"):
        pipe = redis.pipeline(transaction=False)
        for _, traj, ref in refs:
            pipe.xrange(traj, min=ref, max=ref, count=1)
        # An error reply to one lookup is that entry's failure, never the reader's.
        replies = await pipe.execute(raise_on_error=False)
    for (i, traj, ref), reply in zip(refs, replies, strict=True):
        if isinstance(reply, redis_errors.ResponseError):
            out[i] = f"looking up traj entry {ref} of {traj} failed: {reply}"
            continue
        if isinstance(reply, BaseException):  # not a reply at all: the connection failed
            raise BrokerUnavailable(f"redis unavailable while reading trajectories: "
                                    f"{reply}") from reply
        if not reply:
            out[i] = f"traj entry {ref} of {traj} is gone (trimmed or deleted)"
            continue
        try:
            out[i] = join_trajectory(entries[i][1], reply[0][1])
        except DecodeError as exc:
            out[i] = str(exc)
    return out


async def follow(
    redis: aioredis.Redis,
    streams: Sequence[str],
    handle: Callable[[str, str, Fields], Awaitable[None]],
    *,
    start: str = "$",
    block_ms: int = 1000,
    stop: asyncio.Event | None = None,
    limit: int | None = None,
) -> int:
    """Follow streams with plain XREAD (no consumer group: nothing is acked or claimed).

    Calls ``handle(stream, entry_id, fields)`` for each entry from ``start`` on; returns the
    number handled when ``stop`` is set or ``limit`` entries were handled.
    """
    cursors = dict.fromkeys(streams, start)
    if start == "$":  # pin "now" per stream so entries added between reads are not skipped
        async with translated_errors("following"):
            for stream in streams:
                last = await redis.xrevrange(stream, count=1)
                cursors[stream] = _id(last[0][0]) if last else "0-0"
    handled = 0
    while not (stop and stop.is_set()) and (limit is None or handled < limit):
        async with translated_errors("following"):
            if is_cluster(redis) and len(cursors) > 1:  # one slot per command: per stream
                found_each = await asyncio.gather(*(
                    redis.xread({stream: cursor}, count=100, block=min(block_ms, 50) or None)
                    for stream, cursor in cursors.items()))
                reply = [item for found in found_each for item in found or []]
            else:
                # redis-py types the dict invariantly over bytes | str keys
                reply = await redis.xread(cursors, count=100, block=block_ms)  # type: ignore[arg-type]
        if not reply:
            await asyncio.sleep(0.01)  # fakeredis returns at once
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                cursors[name] = _id(entry_id)
                await handle(name, cursors[name], fields)
                handled += 1
                if limit is not None and handled >= limit:
                    return handled
    return handled


async def read_range(
    redis: aioredis.Redis, stream: str, batch: int = 64
) -> AsyncIterator[list[tuple[str, Fields]]]:
    """Every entry of a stream, oldest first, in batches (plain XRANGE: no group, no ack)."""
    start = "-"
    while True:
        async with translated_errors("reading a range"):
            entries = await redis.xrange(stream, min=start, count=batch)
        if not entries:
            return
        yield [(_id(entry_id), fields) for entry_id, fields in entries]
        start = "(" + _id(entries[-1][0])


async def append_entries(redis: aioredis.Redis, stream: str, entries: Sequence[Fields]) -> int:
    """XADD entries to a stream outside any consumer group (rescore output, requeue)."""
    if not entries:
        return 0
    async with translated_errors("appending"):
        pipe = redis.pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(stream, fields)  # type: ignore[arg-type]
        await pipe.execute()
    return len(entries)


@dataclass(frozen=True)
class GroupStats:
    """One consumer group on one stream, as ``rollq status`` shows it."""

    name: str
    consumers: int
    pending: int
    """Entries delivered to a consumer and not yet acked."""
    lag: int | None
    """Entries not yet delivered to the group (None when Redis cannot tell)."""
    oldest_pending_idle_s: float | None
    """Seconds since the oldest pending entry was last delivered."""


@dataclass(frozen=True)
class StreamStats:
    key: str
    length: int
    first_id: str | None
    last_id: str | None
    groups: list[GroupStats]


async def stream_stats(redis: aioredis.Redis, key: str) -> StreamStats | None:
    """Length and per-group delivery state of one stream; None when it does not exist."""
    async with translated_errors("reading stream info"):
        if not await redis.exists(key):
            return None
        info = await redis.xinfo_stream(key)
        groups = []
        for group in await redis.xinfo_groups(key):
            name = _id(group["name"])
            idle = None
            if group["pending"]:
                oldest = await redis.xpending_range(key, name, min="-", max="+", count=1)
                idle = oldest[0]["time_since_delivered"] / 1000 if oldest else None
            groups.append(
                GroupStats(name, int(group["consumers"]), int(group["pending"]),
                           None if group.get("lag") is None else int(group["lag"]), idle)
            )
    first, last = info.get("first-entry"), info.get("last-entry")
    return StreamStats(
        key=key,
        length=int(info["length"]),
        first_id=_id(first[0]) if first else None,
        last_id=_id(last[0]) if last else None,
        groups=groups,
    )


def is_cluster(redis: object) -> bool:
    """Whether ``redis`` is a Redis Cluster client (each partition then has a slot of its
    own, and no command or transaction may span partitions)."""
    return isinstance(redis, RedisCluster)


def is_entry_id(text: str) -> bool:
    """Whether ``text`` is a complete stream entry id Redis can hold: ``ms-seq``, two
    unsigned 64-bit decimal numbers."""
    match = _ENTRY_ID.fullmatch(text)
    return match is not None and all(int(part) <= _MAX_ID_PART for part in match.groups())


def run_of_stream(key: str) -> str | None:
    """The run a partition stream key (``rollq:{<run>:<p>}:<name>``) belongs to; None for
    a key of another shape."""
    match = _STREAM_RUN.match(key)
    return match.group(1) if match else None


def _id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
