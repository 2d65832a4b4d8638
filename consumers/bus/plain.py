"""Streams read and written outside any consumer group: following (``rollq tail``),
reading a range (rescore), appending (rescore output, requeue), and the per-stream
statistics ``rollq status`` shows. Nothing here acks or claims."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from rollq.consumers.bus.entries import as_text, is_cluster, translated_errors
from rollq.schemas import Fields


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
                cursors[stream] = as_text(last[0][0]) if last else "0-0"
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
                cursors[name] = as_text(entry_id)
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
        yield [(as_text(entry_id), fields) for entry_id, fields in entries]
        start = "(" + as_text(entries[-1][0])


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
            name = as_text(group["name"])
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
        first_id=as_text(first[0]) if first else None,
        last_id=as_text(last[0]) if last else None,
        groups=groups,
    )
