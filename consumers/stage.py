"""A pipeline stage: read a stream in a consumer group, transform each entry, forward it
exactly once, and dead-letter what cannot be processed.

What happens to an entry, by what the transform does:

- returns ``Forward(fields)``: the forward script acks it and adds ``fields`` downstream;
- returns ``Drop(reason)``: acked and counted under ``drop:<reason>`` (e.g. a zero-variance
  group under the ``drop`` policy);
- raises: ``schemas.failures.decide`` says what happens, with the entry's delivery count
  as the attempt and the reader's ``max_deliveries`` as the limit, and ``retry_unexpected``
  off:

  - **retry** (a transient failure: Redis or a dependency unavailable; a reward failure:
    a component that raised, timed out or lost its process): the entry is left pending.
    The reader's reclaim (XAUTOCLAIM, which takes this consumer's own idle entries as
    well as a dead consumer's) hands it out again after ``reclaim_idle_ms``;
  - **dead letter** (a contract failure: undecodable, unknown version, a missing reward
    field; a retryable failure on its last delivery; an unexpected exception, i.e. a bug,
    logged with its traceback so one poison entry cannot crash-loop the consumer): moved to
    the dead stream with the verdict's reason and detail, and counted.

A transform may take a whole read at once: when the transform object has a
``batch_transform`` attribute that is not None (the scorer has one: it scores a read's
groups in one call), each read is handed to it in one call, and it returns one result per delivery
(an outcome, or the exception that delivery failed with); each result is then forwarded,
dropped, left pending or dead-lettered on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from rollq.consumers.bus import Delivery, StreamReader
from rollq.schemas import ConfigError, Fields
from rollq.schemas.failures import Kind, Verdict, classify, decide

log = structlog.get_logger("rollq.stage")


@dataclass(frozen=True)
class Forward:
    fields: Fields


@dataclass(frozen=True)
class Drop:
    reason: str


Outcome = Forward | Drop
Transform = Callable[[Delivery], Awaitable[Outcome]]
BatchTransform = Callable[[Sequence[Delivery]], Awaitable[Sequence[Outcome | Exception]]]
"""A read's deliveries → one outcome (or the exception it failed with) per delivery."""

_Settled = Outcome | Verdict | None  # None: left pending for a retry


class Stage:
    """Runs ``transform`` over a consumer group's entries and forwards to ``destination``."""

    def __init__(
        self,
        reader: StreamReader,
        transform: Transform,
        *,
        destination: str = "scored",
        counter: str = "scored",
        concurrency: int = 8,
    ) -> None:
        self.reader = reader
        self.transform = transform
        self.batch_transform: BatchTransform | None = getattr(transform, "batch_transform",
                                                              None)
        self.destination = destination
        self.counter = counter
        self.concurrency = concurrency
        self.forwarded = 0
        self.dropped = 0
        self.dead_lettered = 0
        self.left_pending = 0
        """Failures left pending for a retry (each try counts once)."""

    def _settle(self, delivery: Delivery, exc: Exception) -> Verdict | None:
        """The verdict for a delivery that failed: None (left pending) or a dead letter.
        A configuration error (Redis refused the user a key, a certificate) is the role's,
        not the entry's: it is raised, and the entry stays pending for a fixed role."""
        if isinstance(exc, ConfigError):
            raise exc
        verdict = decide(exc, attempt=delivery.deliveries,
                         max_attempts=self.reader.settings.max_deliveries,
                         retry_unexpected=False)
        if verdict.retry:
            self.left_pending += 1
            log.warning("entry_left_pending", stream=delivery.stream, entry_id=delivery.entry_id,
                        reason=verdict.reason, detail=verdict.detail,
                        deliveries=delivery.deliveries)
            return None
        if classify(exc).kind is Kind.UNEXPECTED:
            log.error("entry_failed", stream=delivery.stream, entry_id=delivery.entry_id,
                      exc_info=exc)
        return verdict

    async def _outcome(self, delivery: Delivery) -> _Settled:
        try:
            return await self.transform(delivery)
        except Exception as exc:
            return self._settle(delivery, exc)

    async def _outcomes(self, deliveries: list[Delivery]) -> list[_Settled]:
        if self.batch_transform is not None:
            try:
                results: Sequence[Outcome | Exception] = await self.batch_transform(deliveries)
            except Exception as exc:  # the whole read failed (e.g. Redis): each delivery did
                results = [exc] * len(deliveries)
            return [self._settle(d, r) if isinstance(r, Exception) else r
                    for d, r in zip(deliveries, results, strict=True)]
        if len(deliveries) <= self.concurrency:
            # The usual case (reads are sized to the concurrency): a semaphore could never
            # make a transform wait, so none is paid for per delivery.
            return list(await asyncio.gather(*(self._outcome(d) for d in deliveries)))
        semaphore = asyncio.Semaphore(self.concurrency)

        async def bounded(delivery: Delivery) -> _Settled:
            async with semaphore:
                return await self._outcome(delivery)

        return list(await asyncio.gather(*(bounded(d) for d in deliveries)))

    async def process(self, deliveries: list[Delivery]) -> None:
        """Transform a batch concurrently, then forward, drop and dead-letter in few trips."""
        outcomes = await self._outcomes(deliveries)
        forwards = [(d, o.fields) for d, o in zip(deliveries, outcomes, strict=True)
                    if isinstance(o, Forward)]
        if forwards:
            ids = await self.reader.forward_many(forwards, self.destination, self.counter)
            self.forwarded += sum(1 for i in ids if i is not None)
        for delivery, outcome in zip(deliveries, outcomes, strict=True):
            if isinstance(outcome, Drop):
                self.dropped += await self.reader.drop([delivery], outcome.reason)
                log.info("group_dropped", entry_id=delivery.entry_id, reason=outcome.reason)
            elif isinstance(outcome, Verdict):
                if await self.reader.dead_letter(delivery, outcome.reason, outcome.detail):
                    self.dead_lettered += 1
                    log.warning("entry_dead_lettered", stream=delivery.stream,
                                entry_id=delivery.entry_id, reason=outcome.reason,
                                detail=outcome.detail)

    async def run(self, stop: asyncio.Event) -> None:
        """Process until ``stop`` is set; the batch in hand is finished first."""
        await self.reader.ensure_groups()
        while not stop.is_set():
            deliveries = await self.reader.next_deliveries()
            if deliveries:
                await self.process(deliveries)

    async def drain(self) -> int:
        """Process everything available now, own pending entries first; for tests and bursts.

        An entry left pending for a retry stays pending (a later ``drain`` or the reclaim
        of ``run`` tries it again). Returns the number of entries handled.
        """
        await self.reader.ensure_groups()
        handled = 0
        pending = await self.reader.read_own_pending(count=10_000)
        if pending:
            await self.process(pending)
            handled += len(pending)
        while deliveries := await self.reader.read(block_ms=0):
            await self.process(deliveries)
            handled += len(deliveries)
        return handled
