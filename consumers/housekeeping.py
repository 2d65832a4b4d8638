"""Housekeeping that keeps a weeks-long run's Redis state flat.

- ``forget_idle_consumers``: every restart of a role under the default ``host-pid``
  consumer name adds a consumer to its group; one that has nothing pending and has been
  idle longer than ``idle_ms`` is removed (``XGROUP DELCONSUMER`` would drop the pending
  entries of a consumer that still had some, so those are never touched: they are
  reclaimed first, and the consumer goes on a later pass).
- ``trim_dead``: dead letters are kept ``retention_ms`` (the operator's window to inspect
  and requeue them), then trimmed by age; the ``drop:<reason>`` counters keep the count.

Scorers run both on their trim cycle (``ops.roles``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from rollq.consumers.bus import translated_errors

# KEYS[1] stream; ARGV[1] group, ARGV[2] idle ms, ARGV[3] a name to keep. Deletes, in one
# atomic step, the consumers with nothing pending that have been idle that long.
_FORGET = """
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if info['name'] ~= ARGV[3] and info['pending'] == 0 and info['idle'] >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed = removed + 1
  end
end
return removed
"""


async def forget_idle_consumers(redis: aioredis.Redis, streams: Sequence[str], group: str,
                                idle_ms: int, *, keep: str = "") -> int:
    """Remove ``group``'s consumers with nothing pending, idle at least ``idle_ms`` (never
    ``keep``, the caller itself). Returns how many were removed. A consumer that is alive
    reads at least every ``block_ms``, which resets its idle time (Redis 7)."""
    removed = 0
    async with translated_errors("cleaning up consumers"):
        for stream in streams:
            if not await redis.exists(stream):
                continue
            groups = {_text(g["name"]) for g in await redis.xinfo_groups(stream)}
            if group in groups:
                removed += int(await redis.eval(_FORGET, 1, stream, group, str(idle_ms), keep))
    return removed


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def trim_dead(redis: aioredis.Redis, streams: Sequence[str], retention_ms: int) -> int:
    """Trim dead-letter streams of letters older than ``retention_ms``; returns how many."""
    floor = f"{max(0, int(time.time() * 1000) - retention_ms)}-0"
    removed = 0
    async with translated_errors("trimming dead letters"):
        for stream in streams:
            removed += int(await redis.xtrim(stream, minid=floor, approximate=False))
    return removed
