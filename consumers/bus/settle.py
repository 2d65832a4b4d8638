"""Settling delivered entries exactly once: ack, forward, drop and dead-letter.

- ``forward`` is exactly-once: in one MULTI/EXEC it XADDs the new entries and then runs a
  small script that XACKs their source entries; XACK returns 1 only to the first acker, and
  for each XACK that returns 0 the script deletes that entry's copy just added. EXEC is
  atomic, so no reader ever sees such a copy: of two consumers racing on a reclaimed entry
  exactly one forwards it. ``forward_many`` runs one script per source stream, not one per
  entry. The payload stays out of Lua on purpose: a dead letter carries a whole group, and
  copying a 0.5 MB group into script arguments cost Redis 7.0 three times the CPU of the
  XADD itself (measured with bench/bus.py's groups).
- ``dead_letter``, ``drop`` and ``ack_counted`` run one script (per stream) that acks and
  counts only the entries this call acked first (and, for dead letters, adds the letter).
  Every count is exact.
- On a Redis Cluster every transaction and script keeps to one partition's slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from rollq.consumers.bus.entries import Delivery, as_text, is_cluster, translated_errors
from rollq.schemas import DeadLetter, Fields, encode_dead
from rollq.schemas.keys import DROP_PREFIX, partner_key

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


class EntrySettler:
    """The settling verbs of one consumer group (``StreamReader`` is one)."""

    def __init__(self, redis: aioredis.Redis, group: str) -> None:
        self.redis = redis
        self.group = group
        self._ack_and_count = redis.register_script(_ACK_AND_COUNT)

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
                    results[index] = as_text(replies[position + offset])
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
