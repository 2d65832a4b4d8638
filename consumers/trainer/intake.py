"""What happens to a delivered scored entry before it can reach a batch.

No entry can stop the client: whatever it cannot handle for one entry is dead-lettered,
with the reason ``schemas.failures`` gives, and the client goes on:

- delivered more than ``max_deliveries`` times (it was handed out and never acked that
  often, e.g. it crashed the trainer each time): dead-lettered as ``max_deliveries`` by
  the reader, on re-reads of the client's own pending entries as on reclaims;
- its ``run`` is not this client's run, or its trajectory's traj entry is gone or cannot
  be looked up: dead-lettered by the reader (``decode_error``, ``trajectory_missing``);
- it does not decode, or holds a value the contract forbids (``schemas.codec`` checks
  values, and token ids against ``vocab_size`` when set): dead-lettered with the reason
  (``decode_error``, ``unknown_version_error``; ``unexpected_error`` for a bug) and
  counted (``drop:<reason>``);
- it decodes but cannot be laid out into a batch (the batch build fails and that group
  alone fails too): dead-lettered the same way, and the batch is built without it;
- its ``group_id`` is already in the client's hands or recorded as trained (a re-run of
  a rollout job republished it): acked and counted ``drop:duplicate``; if the recorded
  entry is this very entry (the crash fell between recording and acking), the ack is
  completed and counted ``consumed``;
- stale at batch time (``is_stale``): acked and counted ``drop:stale``.
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from rollq.consumers.bus import Delivery, StreamReader
from rollq.consumers.trainer.holdings import HeldGroup, Holdings
from rollq.consumers.trainer.ledger import Ledger
from rollq.consumers.trainer.settings import TrainerClientSettings
from rollq.schemas.columns import ScoredColumns
from rollq.schemas.decoding import decode_scored_columns
from rollq.schemas.failures import decide
from rollq.schemas.keys import CONSUMED_COUNTER

log = structlog.get_logger("rollq.trainer")


async def admit(deliveries: list[Delivery], reader: StreamReader, ledger: Ledger, books: Holdings,
                settings: TrainerClientSettings, run: str) -> None:
    """Decode, dedup and queue deliveries (into ``books``)."""
    candidates: list[tuple[Delivery, ScoredColumns]] = []
    for d in deliveries:
        if (d.stream, d.entry_id) in books.held:
            continue  # already ours (queued, replaying, or in an unacked batch)
        try:
            candidates.append((d, decode_scored_columns(
                d.fields, run=run, vocab_size=settings.vocab_size)))
        except Exception as exc:  # DecodeError, or a bug: either way this entry's
            await reject(d, exc, reader, settings)
    recorded = await ledger.seen(
        [g.group_id for _, g in candidates if g.group_id not in books.seen])
    duplicates: list[Delivery] = []
    unfinished: list[Delivery] = []
    for d, group in candidates:
        ref = f"{d.stream} {d.entry_id}"
        trained = books.seen.get(group.group_id) or recorded.get(group.group_id)
        if trained == ref:
            unfinished.append(d)
        elif trained is not None or books.holds_group(group.group_id):
            duplicates.append(d)
        else:  # keep the decoded columns (they view the entry's bytes)
            books.hold(HeldGroup(replace(d, fields={}), group, replay=False))
    if duplicates:
        await reader.drop(duplicates, "duplicate")
        log.info("groups_dropped", run=run, reason="duplicate", count=len(duplicates))
    if unfinished:
        await reader.ack_counted(unfinished, CONSUMED_COUNTER)


async def drop_stale(version: int, reader: StreamReader, books: Holdings,
                     settings: TrainerClientSettings, run: str) -> None:
    """Drop (ack, counted ``drop:stale``) the queued groups too old for ``version``."""
    stale = books.take_stale(version, settings.max_staleness)
    if not stale:
        return
    await reader.drop([h.delivery for h in stale], "stale")
    log.info("groups_dropped", run=run, reason="stale", count=len(stale),
             policy_version=version)


async def reject(delivery: Delivery, exc: Exception, reader: StreamReader,
                 settings: TrainerClientSettings, *, refetch: bool = False) -> None:
    """Settle an entry this client cannot use, by ``schemas.failures.decide``: dead-letter
    it with the reason (contract errors and bugs at once), or leave it pending for a
    later delivery (a transient failure while deliveries remain). ``refetch``: the
    delivery no longer holds its fields (a decoded group keeps none): the letter
    carries the entry as stored."""
    verdict = decide(exc, attempt=delivery.deliveries,
                     max_attempts=settings.max_deliveries, retry_unexpected=False)
    if verdict.retry:
        log.warning("entry_left_pending", stream=delivery.stream,
                    entry_id=delivery.entry_id, reason=verdict.reason,
                    detail=verdict.detail, deliveries=delivery.deliveries)
        return
    if refetch:
        delivery = replace(delivery, fields=await reader.fetch(
            delivery.stream, delivery.entry_id) or {})
    lettered = await reader.dead_letter(delivery, verdict.reason, verdict.detail)
    log.warning("entry_dead_lettered", stream=delivery.stream, entry_id=delivery.entry_id,
                reason=verdict.reason, detail=verdict.detail, lettered=lettered)
