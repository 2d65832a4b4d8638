"""Dead-lettering scored entries whose trajectory reference can never be joined.

A reference-form scored entry names its traj entry by id (``traj``). One that names no id
the partition's traj stream can hold (malformed, older than its first entry, newer than its
last id) would pin that stream's trimming and fail in every trainer that reads it. The
trim (``consumers.bus.trimming``) finds such entries that no consumer group of the scored
stream was delivered yet; each is moved here to the partition's dead stream as
``trajectory_missing``, counted under ``drop:trajectory_missing``.

Exactly once, and never under a reader's feet: the dead letter is XADDed and a script run
in one MULTI/EXEC; the script deletes the scored entry only while it is still there and
still undelivered to every group (else it removes the letter just added, and the entry's
reader settles it as usual).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus.entries import is_entry_id, translated_errors
from rollq.consumers.bus.join import not_an_entry_id
from rollq.schemas import DeadLetter, encode_dead, trajectory_ref
from rollq.schemas.failures import TRAJECTORY_MISSING
from rollq.schemas.keys import DROP_PREFIX, partner_key

log = structlog.get_logger("rollq.bus")
TRIMMER_GROUP = "trimmer"
"""The ``consumer_group`` of these dead letters: no group read them, the trim found them."""

# Runs inside MULTI right after the caller XADDed the letter to KEYS[2]. KEYS[1] scored
# stream, KEYS[3] counters hash; ARGV[1] the scored entry's id, ARGV[2] counter field.
# An entry is delivered to a group when its id is at most the group's last-delivered-id:
# XRANGE from the id to that one holds it then (no id arithmetic in Lua).
_TAKE = """
local function undo()
  local added = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  redis.call('XDEL', KEYS[2], added[1][1])
  return 0
end
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return undo() end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  for i = 1, #g, 2 do
    if g[i] == 'last-delivered-id' and
        #redis.call('XRANGE', KEYS[1], ARGV[1], g[i + 1], 'COUNT', 1) > 0 then
      return undo()
    end
  end
end
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return 1
"""


async def dead_letter_orphans(redis: aioredis.Redis, scored: str,
                              entry_ids: Sequence[str]) -> int:
    """Move the entries ``entry_ids`` of the ``scored`` stream to the dead stream of its
    partition (see the module docstring); returns how many this call moved."""
    moved = 0
    traj, dead = partner_key(scored, "traj"), partner_key(scored, "dead")
    for entry_id in entry_ids:
        async with translated_errors("dead-lettering an orphan"):
            found = await redis.xrange(scored, min=entry_id, max=entry_id, count=1)
        if not found:
            continue
        fields = found[0][1]
        ref = trajectory_ref(fields) or fields.get(b"traj", b"").decode(errors="replace")
        letter = DeadLetter(
            reason=TRAJECTORY_MISSING, source_stream=scored, source_id=entry_id,
            consumer_group=TRIMMER_GROUP, dead_at=time.time(), payload=dict(fields),
            detail=(not_an_entry_id(ref) if not is_entry_id(ref) else
                    f"traj entry {ref} of {traj} is gone (older than its first entry) or "
                    "was never there (newer than its last id)"))
        async with translated_errors("dead-lettering an orphan"):
            pipe = redis.pipeline(transaction=True)
            pipe.xadd(dead, encode_dead(letter))  # type: ignore[arg-type]
            pipe.eval(_TAKE, 3, scored, dead, partner_key(scored, "counters"), entry_id,
                      DROP_PREFIX + TRAJECTORY_MISSING)
            _, taken = await pipe.execute()
        if int(taken):
            moved += 1
            log.warning("entry_dead_lettered", stream=scored, entry_id=entry_id,
                        reason=TRAJECTORY_MISSING, detail=letter.detail)
    return moved
