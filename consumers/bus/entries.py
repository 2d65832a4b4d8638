"""What every part of the bus shares: a delivered entry, entry ids, the cluster test and
(from ``schemas.errors``) the translation of connection failures."""

from __future__ import annotations

import re
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from rollq.schemas import Fields
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import PREFIX

__all__ = ["Delivery", "as_text", "id_order", "is_cluster", "is_entry_id", "run_of_stream",
           "translated_errors"]

_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")  # ASCII digits: \d takes any script's
_MAX_ID_PART = 2**64 - 1  # a stream id is two unsigned 64-bit numbers, ms-seq
_STREAM_RUN = re.compile(re.escape(PREFIX) + r":\{([A-Za-z0-9_.\-]+):[0-9]+\}:")


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this consumer."""

    stream: str
    entry_id: str
    fields: Fields
    deliveries: int = 1
    """Times the entry has been delivered, this delivery included."""


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


def as_text(value: bytes | str) -> str:
    """A stream key, entry id or group name as text (redis-py replies give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def id_order(entry_id: str) -> tuple[int, int]:
    """Sort key of an entry id: (ms, seq) as numbers."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
