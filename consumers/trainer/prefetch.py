"""``Prefetcher``: the next batch prepared while the caller trains (``prefetch=True``).

Once ``TrainerClient.next_batch`` returns batch N, a background task prepares batch N+1
with the same size arguments: it reads, checks (every rule of ``consumers.trainer.client``),
decodes and lays it out, so the caller's training step hides that work. The rules:

- At most one batch is prepared. Its groups stay first in the client's queue (held,
  pending in Redis, not acked) until it is handed out, so discarding it loses and
  reorders nothing.
- The next call with the same sizes waits for the task and hands out its batch. While no
  call waits, the task reads without blocking (pausing up to ``PREFETCH_POLL_S`` when the
  stream is dry), so that it can be cancelled at any moment: an abandoned blocking read
  could still deliver entries to a client that no longer expects them. Once a call waits,
  the task reads as that call would, until the call's ``timeout_s``, and then returns what
  is queued. A call with other sizes cancels the task, and so does the client's close:
  the groups it prepared are simply the next in line, or stay pending for the next start.
  As after an outage, the client then takes back, without counting a delivery, what Redis
  holds for it and it does not (a read cancelled after Redis answered it).
- Staleness is judged when the batch is handed out: if a group of it is stale at the
  version then in force, the batch is not handed out and the call takes the ordinary
  path, which drops that group as ``drop:stale`` and refills. Replays are never stale.
- What the task meets is what the next call would have met: poison is dead-lettered with
  the same reason (and the batch refilled); a Redis outage ends the task, and the next
  call starts over as a call without prefetch would: if Redis is still away it rides the
  outage out (logged, ``redis_give_up_s`` timed from that call), else nothing is logged;
  any other error is raised by the next call. An error of a task that no call collects
  (the client closed) is logged, ``batch_prefetch_failed``.
- ``ack``, ``state`` and ``publish_policy`` may run while the task works: it only adds
  groups to the queue and takes dropped ones out, while ``ack`` settles the groups of
  handed-out batches, which are no longer queued. Calls of ``next_batch`` (and
  ``load_state``) are serialised by the client's lock, and a call settles the task
  before it reads.

This module owns the task's lifecycle; the client owns the books and the reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollq.consumers.trainer.batch import Batch
from rollq.consumers.trainer.holdings import HeldGroup
from rollq.consumers.trainer.sizing import BatchSize
from rollq.schemas import BrokerUnavailable

log = structlog.get_logger("rollq.trainer")

PREFETCH_POLL_S = 0.05
"""Longest pause between the non-blocking reads of a prefetch that no call waits for yet
(seconds): when the stream is dry, one cheap read per trainer this often."""


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """A batch laid out from the first groups of the client's queue, which stay queued until
    it is handed out."""

    batch: Batch
    held: tuple[HeldGroup, ...]
    version: int
    """The policy version its groups were checked against."""


@dataclass(eq=False)
class Prefetch:
    """One background preparation: the sizes it was asked with, and how it must read."""

    size: BatchSize
    awaited: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while a call waits for it: it then reads as that call would, until ``deadline``."""
    deadline: float | None = None
    """The waiting call's deadline (``time.monotonic``), None for none."""
    task: asyncio.Task[PreparedBatch] = field(init=False)

    @property
    def idle(self) -> asyncio.Event | None:
        """While no call waits: the event to pause on between non-blocking reads."""
        return None if self.awaited.is_set() else self.awaited


Prepare = Callable[[BatchSize, Prefetch], Coroutine[Any, Any, PreparedBatch]]
"""Assembles a batch of the given sizes, reading as the ``Prefetch`` says."""


class Prefetcher:
    """Runs at most one ``Prefetch`` of the next batch (module docstring)."""

    def __init__(self, prepare: Prepare, *, run: str, name: str) -> None:
        self._prepare = prepare
        self._run = run
        self._name = name
        self.current: Prefetch | None = None
        """The prefetch not yet taken or cancelled."""

    @property
    def finished(self) -> bool:
        """Whether the current prefetch has ended (prepared, or failed)."""
        return self.current is not None and self.current.task.done()

    def start(self, size: BatchSize) -> None:
        """Prepare the next batch of ``size`` in the background (after a hand-out)."""
        prefetch = Prefetch(size)
        prefetch.task = asyncio.create_task(self._prepare(size, prefetch), name=self._name)
        self.current = prefetch

    async def take(self, size: BatchSize,
                   deadline: float | None) -> tuple[PreparedBatch | None, bool]:
        """The prepared batch when it was prepared with ``size``, waited for until
        ``deadline`` (the task takes over that deadline: it then returns what is queued,
        as the call would); None after other sizes, the task cancelled (its groups stay
        queued). The flag says whether the client must take back what Redis holds for it
        and it does not (a read cancelled, or cut by an outage, after Redis answered it).

        Raises what the task raised, but for ``BrokerUnavailable``: the call reads again,
        and rides out the outage if it lasts."""
        prefetch = self.current
        if prefetch is None:
            return None, False
        task = prefetch.task
        if prefetch.size == size and not task.done():
            prefetch.deadline = deadline
            prefetch.awaited.set()
            try:
                await asyncio.wait({task})
            finally:  # the call was cancelled: the task goes back to polling for the next
                prefetch.awaited.clear()
                prefetch.deadline = None
        cancelled = not task.done()
        if cancelled:  # no call waits for it: it polls, no blocking read is abandoned
            task.cancel()
            await asyncio.wait({task})
        self.current = None  # only now: a call cancelled while waiting leaves it to the next
        if prefetch.size != size:
            log.info("batch_prefetch_discarded", run=self._run, reason="size")
        if task.cancelled():
            return None, cancelled
        if isinstance(task.exception(), BrokerUnavailable):
            return None, True
        prepared = task.result()  # any other error is the call's
        return (prepared if prefetch.size == size else None), False

    async def cancel(self) -> None:
        """Cancel the current prefetch (the client closes); an error it had ended with is
        logged, not raised: no call is left to raise it from."""
        prefetch = self.current
        if prefetch is None:
            return
        prefetch.task.cancel()
        await asyncio.wait({prefetch.task})
        self.current = None
        if prefetch.task.cancelled():
            return
        error = prefetch.task.exception()
        if error is not None:
            log.warning("batch_prefetch_failed", run=self._run, error=repr(error)[:300])
