"""The producers' one XADD: publish whole trajectory groups onto a run's traj stream.

The partition is a stable hash of ``group_id``, so a re-run of a job (same ``group_id``)
lands in the same partition as the first run and downstream dedup sees both. Streams are
never capped on XADD: MAXLEN would drop unread groups (see ``consumers.bus`` for safe trims).
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from rollq.schemas import (
    ContractError,
    DeadLetter,
    TrajectoryGroup,
    encode,
    encode_dead,
)
from rollq.schemas.errors import translated_errors
from rollq.schemas.failures import ENTRY_TOO_LARGE
from rollq.schemas.keys import (
    DROP_PREFIX,
    check_run_name,
    counters_key,
    partition_of,
    stream_key,
)
from rollq.schemas.runs import register_run


class EntryTooLarge(ContractError):
    """A group's encoded entry is above ``max_entry_bytes``: dead-lettered at once as
    ``entry_too_large`` (``schemas.failures``), never XADDed."""

    reason = ENTRY_TOO_LARGE


class Publisher:
    """Publishes trajectory groups of one run.

    ``max_entry_bytes`` caps one encoded group (field names + values, as Redis stores
    them); a larger one raises ``EntryTooLarge`` before anything is written. None: no cap.
    """

    def __init__(self, redis: aioredis.Redis, run: str, partitions: int = 1, *,
                 max_entry_bytes: int | None = None) -> None:
        if partitions < 1:
            raise ValueError("partitions must be at least 1")
        if max_entry_bytes is not None and max_entry_bytes < 1:
            raise ValueError("max_entry_bytes must be at least 1 or None")
        self.redis = redis
        self.run = check_run_name(run)
        self.partitions = partitions
        self.max_entry_bytes = max_entry_bytes
        self._registered = False

    async def register(self) -> int:
        """Record the run and its partition count (first writer wins); returns the count in
        force, which is the one to publish with."""
        self.partitions = (await register_run(self.redis, self.run, self.partitions)).partitions
        self._registered = True
        return self.partitions

    async def publish(self, group: TrajectoryGroup) -> str:
        """XADD one group to its partition's traj stream; returns the entry id."""
        if group.run != self.run:
            raise ValueError(f"group belongs to run {group.run!r}, publisher to {self.run!r}")
        if not self._registered:
            await self.register()
        key = stream_key(self.run, partition_of(group.group_id, self.partitions), "traj")
        fields = encode(group)
        if self.max_entry_bytes is not None:
            size = sum(len(name) + len(value) for name, value in fields.items())
            if size > self.max_entry_bytes:
                raise EntryTooLarge(
                    f"group {group.group_id}: its entry is {size:,} bytes ({group.num_tokens:,} "
                    f"tokens in {len(group.completions)} completions), above max_entry_bytes "
                    f"{self.max_entry_bytes:,}")
        async with translated_errors("publishing"):
            entry_id = await self.redis.xadd(key, fields)  # type: ignore[arg-type]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def publish_failure(self, group_id: str, reason: str, detail: str,
                              payload: dict[bytes, bytes] | None = None) -> str:
        """Record a job that will never produce its group: a dead letter with the reason,
        counted under ``drop:<reason>`` so the admission budget frees its slot."""
        if not self._registered:
            await self.register()
        partition = partition_of(group_id, self.partitions)
        letter = DeadLetter(
            reason=reason, detail=detail, source_stream=f"jobs:{self.run}", source_id=group_id,
            consumer_group="workers", dead_at=time.time(), payload=payload or {},
        )
        # ``async with``: a job cancelled (timed out) inside ``execute`` gives the pipeline's
        # connection back; a bare pipeline would keep it until the garbage collector warns
        async with translated_errors("recording a failure"), \
                self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(stream_key(self.run, partition, "dead"), encode_dead(letter))  # type: ignore[arg-type]
            pipe.hincrby(counters_key(self.run, partition), DROP_PREFIX + reason, 1)
            entry_id, _ = await pipe.execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
