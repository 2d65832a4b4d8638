"""The join of scored entries with their trajectories.

A scored entry names its trajectory's traj entry instead of copying it (see
``schemas.codec``); readers that hand groups to a trainer merge that entry in, one
pipelined XRANGE per batch. Where the named entry is gone or cannot be looked up, the
reason comes back instead of fields, for the caller to dead-letter (``trajectory_missing``).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from rollq.consumers.bus.entries import is_entry_id, translated_errors
from rollq.schemas import BrokerUnavailable, DecodeError, Fields, join_trajectory, trajectory_ref
from rollq.schemas.keys import partner_key


def not_an_entry_id(ref: str) -> str:
    """Why a scored entry whose ``traj`` field is ``ref`` (not an entry id) cannot join."""
    return (f"field 'traj' is not a stream entry id (two unsigned 64-bit numbers, ms-seq): "
            f"{ref[:40]!r}")


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
            out[i] = not_an_entry_id(ref)
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
