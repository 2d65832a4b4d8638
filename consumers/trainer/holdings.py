"""What a trainer client holds between Redis and the user's training step.

A scored group, once read and decoded (to its columns: ``schemas.columns``), is *held*
until its batch is acked (or it is dropped or dead-lettered): first in the queue of groups
ready for a batch, then in an unacked batch. ``Holdings`` keeps the one set of books the
client consults:

- ``queue``: held groups ready for a batch, in order (a prefetched batch is laid out from
  the first of them and they stay queued until it is handed out: discarding it puts
  nothing back, so nothing can be lost or reordered);
- ``held``: every held group by (stream, entry id), queued or in an unacked batch, so a
  re-delivery of an entry the client already has is recognised (and a recovery after an
  outage does not take it again);
- the group ids held, so that a second entry of a group in hand is a duplicate;
- ``replays``: groups re-delivered by ``load_state`` (trained before the crash, not yet
  acked again): they are not recorded twice;
- ``seen``: a bounded cache of recently acked group ids (the seen-set in Redis is the
  truth; this spares a round trip for the copies that arrive soon after).

Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rollq.consumers.bus import Delivery
from rollq.consumers.trainer.staleness import is_stale
from rollq.schemas.columns import ScoredColumns

SEEN_CACHE = 10_000
"""Recent acks remembered in memory (a fast path: the seen-set in Redis is the truth); small
enough that a trainer's memory plateaus within minutes."""

Ref = tuple[str, str]
"""(stream, entry id) of a held group."""


@dataclass(eq=False)
class HeldGroup:
    """A decoded group in the client's hands, with the delivery it came from (its fields
    dropped: the decoded columns are kept, which view the entry's bytes)."""

    delivery: Delivery
    group: ScoredColumns
    replay: bool
    """Re-delivered by ``load_state``: trained once already, acked again without a record."""

    @property
    def ref(self) -> Ref:
        return (self.delivery.stream, self.delivery.entry_id)


class Holdings:
    """The client's books of held groups (module docstring)."""

    def __init__(self, seen_cache: int = SEEN_CACHE) -> None:
        self.queue: deque[HeldGroup] = deque()
        self.held: dict[Ref, HeldGroup] = {}
        self.replays: dict[Ref, str] = {}
        self.seen: dict[str, str] = {}
        """group id -> ``"stream entry_id"`` of its trained entry, recent acks only."""
        self._groups: dict[str, Ref] = {}
        self._seen_cache = seen_cache

    def holds_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def hold(self, held: HeldGroup) -> None:
        """Queue ``held`` (at the back) and enter it in the books; a replay is listed too."""
        self.queue.append(held)
        self.held[held.ref] = held
        self._groups[held.group.group_id] = held.ref
        if held.replay:
            self.replays[held.ref] = held.group.group_id

    def peek(self, count: int) -> list[HeldGroup]:
        """The first ``count`` queued groups, left in the queue."""
        return list(itertools.islice(self.queue, count))

    def leads_with(self, held: Sequence[HeldGroup]) -> bool:
        """Whether the queue starts with exactly ``held``, in that order."""
        return len(self.queue) >= len(held) and all(
            a is b for a, b in zip(self.queue, held, strict=False))

    def take(self, count: int) -> list[HeldGroup]:
        """The first ``count`` queued groups, out of the queue (still held)."""
        return [self.queue.popleft() for _ in range(count)]

    def remove(self, held: Collection[HeldGroup]) -> None:
        """Take ``held`` out of the queue and out of the books (dropped or dead-lettered)."""
        if held:
            self.queue = deque(h for h in self.queue if h not in held)
            for item in held:
                self.release(item)

    def release(self, held: HeldGroup) -> None:
        """Out of the books: its batch was acked, or it was dropped or dead-lettered."""
        self.held.pop(held.ref, None)
        self.replays.pop(held.ref, None)
        if self._groups.get(held.group.group_id) == held.ref:
            del self._groups[held.group.group_id]

    def remember(self, held: HeldGroup) -> None:
        """Note ``held`` as trained (after its ack), forgetting the oldest beyond the cache."""
        self.seen[held.group.group_id] = f"{held.ref[0]} {held.ref[1]}"
        if len(self.seen) > self._seen_cache:
            del self.seen[next(iter(self.seen))]

    def take_stale(self, version: int, max_staleness: int | None) -> list[HeldGroup]:
        """Take out of the queue and the books the queued groups stale at ``version``
        (replays never are: they were admitted once)."""
        stale = [h for h in self.queue if not h.replay and is_stale(
            h.group.policy_version, version, max_staleness)]
        self.remove(stale)
        return stale
