"""``SessionGate``: a session group is admitted under the run's staleness budget like a job.

The budget is the feeder's (``producers.admission.admit``, DESIGN.md §4): one session group
takes one slot, as one rollout job does, and gives it back when the trainer consumes the
group or it is dropped (a dead letter, e.g. ``session_expired``). A group is admitted by a
compare-and-increment of the run's ``admitted`` count: the budget read from Redis is
spent only if no one admitted anything since (another gateway process, an open a moment
earlier), else it is read again. When there is no slot the open is refused at once
(``AdmissionRefused``: the gateway answers 429 with ``Retry-After``), never queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from rollq.producers.admission import admit
from rollq.producers.feeder import read_feed_state
from rollq.schemas import TransientError
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import ADMITTED_FIELD, state_key

# KEYS[1] run state; ARGV[1] the admitted count the budget was read with.
_TAKE = f"""
if tonumber(redis.call('HGET', KEYS[1], '{ADMITTED_FIELD}') or '0') ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('HINCRBY', KEYS[1], '{ADMITTED_FIELD}', 1)
return 1
"""


class AdmissionRefused(TransientError):
    """The run's staleness budget has no slot now: try again later."""

    def __init__(self, message: str, *, version: int, outstanding: int) -> None:
        super().__init__(message)
        self.version = version
        self.outstanding = outstanding


@dataclass
class SessionGate:
    """Admits session groups of one run (module docstring)."""

    redis: aioredis.Redis
    run: str
    max_staleness: int
    batch_groups: int
    tries: int = 8
    """Reads of the budget before a contended admission gives up (and is refused)."""

    def __post_init__(self) -> None:
        self._take = self.redis.register_script(_TAKE)

    async def admit_one(self) -> int:
        """Take one slot; the policy version it was taken under. ``AdmissionRefused`` when
        the budget is spent."""
        for _ in range(self.tries):
            async with translated_errors("admitting a session group"):
                state = await read_feed_state(self.redis, self.run)
                free = admit(state.version, state.consumed, state.outstanding,
                             max_staleness=self.max_staleness, batch_groups=self.batch_groups)
                if free <= 0:
                    raise AdmissionRefused(
                        f"run {self.run!r} has no admission slot: {state.outstanding} groups "
                        f"outstanding at policy version {state.version} (max_staleness "
                        f"{self.max_staleness}, batch_groups {self.batch_groups}); the trainer "
                        "must consume some first", version=state.version,
                        outstanding=state.outstanding)
                if await self._take(keys=[state_key(self.run)], args=[state.admitted]):
                    return state.version
        raise AdmissionRefused(f"run {self.run!r}: admission contended {self.tries} times",
                               version=state.version, outstanding=state.outstanding)

    async def give_back(self) -> None:
        """Return a slot taken by ``admit_one`` that no group uses (a racing open of the
        same group won)."""
        async with translated_errors("giving back an admission slot"):
            await self.redis.hincrby(state_key(self.run), ADMITTED_FIELD, -1)
