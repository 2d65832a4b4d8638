"""A pipeline stage: read a stream in a consumer group, transform each entry, forward it
exactly once, and dead-letter what cannot be processed.

What happens to an entry, by what the transform does:

- returns ``Forward(fields)``: the forward script acks it and adds ``fields`` downstream;
- returns ``Drop(reason)``: acked and counted under ``drop:<reason>`` (e.g. a zero-variance
  group under the ``drop`` policy);
- raises ``ContractError`` (undecodable, unknown version, a reward configured to
  dead-letter): moved to the dead stream with the reason; retrying cannot help;
- raises ``TransientError``: left unacked; it is retried after ``reclaim_idle_ms``, and
  dead-lettered once it has been delivered ``max_deliveries`` times;
- raises anything else: a bug; it is dead-lettered with reason ``unexpected_error`` so one
  poison entry cannot crash-loop the consumer, and logged with its traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from consumers.bus import Delivery, StreamReader
from schemas import ContractError, Fields, RewardError, TransientError

log = structlog.get_logger("rollq.stage")


@dataclass(frozen=True)
class Forward:
    fields: Fields


@dataclass(frozen=True)
class Drop:
    reason: str


Outcome = Forward | Drop
Transform = Callable[[Delivery], Awaitable[Outcome]]


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
        self.destination = destination
        self.counter = counter
        self.concurrency = concurrency
        self.forwarded = 0
        self.dropped = 0
        self.dead_lettered = 0

    async def _outcome(self, delivery: Delivery) -> Outcome | tuple[str, str] | None:
        try:
            return await self.transform(delivery)
        except TransientError as exc:
            log.warning("entry_left_pending", entry_id=delivery.entry_id, error=str(exc))
            return None
        except (ContractError, RewardError) as exc:
            return (_reason(exc), str(exc))
        except Exception as exc:  # a bug: dead-letter rather than crash-loop on it
            log.exception("entry_failed", entry_id=delivery.entry_id)
            return ("unexpected_error", f"{type(exc).__name__}: {exc}")

    async def process(self, deliveries: list[Delivery]) -> None:
        """Transform a batch concurrently, then forward, drop and dead-letter in few trips."""
        if len(deliveries) <= self.concurrency:
            # The usual case (reads are sized to the concurrency): a semaphore could never
            # make a transform wait, so none is paid for per delivery.
            outcomes = await asyncio.gather(*(self._outcome(d) for d in deliveries))
        else:
            semaphore = asyncio.Semaphore(self.concurrency)

            async def bounded(delivery: Delivery) -> Outcome | tuple[str, str] | None:
                async with semaphore:
                    return await self._outcome(delivery)

            outcomes = await asyncio.gather(*(bounded(d) for d in deliveries))
        forwards = [(d, o.fields) for d, o in zip(deliveries, outcomes, strict=True)
                    if isinstance(o, Forward)]
        if forwards:
            ids = await self.reader.forward_many(forwards, self.destination, self.counter)
            self.forwarded += sum(1 for i in ids if i is not None)
        for delivery, outcome in zip(deliveries, outcomes, strict=True):
            if isinstance(outcome, Drop):
                self.dropped += await self.reader.drop([delivery], outcome.reason)
                log.info("group_dropped", entry_id=delivery.entry_id, reason=outcome.reason)
            elif isinstance(outcome, tuple):
                reason, detail = outcome
                if await self.reader.dead_letter(delivery, reason, detail):
                    self.dead_lettered += 1
                    log.warning("entry_dead_lettered", stream=delivery.stream,
                                entry_id=delivery.entry_id, reason=reason, detail=detail)

    async def run(self, stop: asyncio.Event) -> None:
        """Process until ``stop`` is set; the batch in hand is finished first."""
        await self.reader.ensure_groups()
        while not stop.is_set():
            deliveries = await self.reader.next_deliveries()
            if deliveries:
                await self.process(deliveries)

    async def drain(self) -> int:
        """Process everything available now, own pending entries first; for tests and bursts.

        Returns the number of entries handled.
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


def _reason(exc: Exception) -> str:
    """The exception's own ``reason`` slug if it has one (``RewardError``), else one from
    the class name: DecodeError -> decode_error."""
    own = getattr(exc, "reason", None)
    if isinstance(own, str) and own:
        return f"reward_{own}" if isinstance(exc, RewardError) else own
    name = type(exc).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
