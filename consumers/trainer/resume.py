"""Resume: a trainer's checkpoint state, and the groups it must train again.

Resume design (checkpoint/resume neither skips nor repeats a group):

- ``batch.ack()`` first records the batch in the run's seen-hash and in this consumer's
  *trained log* (a Redis stream, one entry per batch listing its ``group_id, stream,
  entry_id`` triples, in ack order; one MULTI), then acks with
  ``ack_counted(..., "consumed")``.
- ``state()`` (take it after the ``ack`` of the last step in the checkpoint) is the id of
  the last log entry plus the groups still to be replayed from an earlier resume. Batches
  handed out but not acked are not in it, nor a prefetched batch not yet handed out: they
  are not trained, and stay pending (replays stay listed to be replayed).
- ``load_state(state)`` re-delivers, before anything else, every group the state's log
  holds after that id: groups acked after the checkpoint whose training was lost with the
  crash. Their entries are fetched from the scored streams by id (and joined with their
  traj entries), so the streams must keep acked entries at least one checkpoint interval
  (``retention`` when trimming);
  a trimmed entry raises ResumeError instead of silently skipping. Unacked batches come
  back through the pending list (own pending, or reclaim under another consumer name).
- Replayed groups are not recorded twice and are never stale-checked (they were admitted
  once); acking them counts ``consumed`` only for an entry still pending.
"""

from __future__ import annotations

from typing import Any

from rollq.consumers.bus import Delivery, is_entry_id, run_of_stream
from rollq.consumers.trainer.errors import ResumeError
from rollq.consumers.trainer.holdings import HeldGroup
from rollq.consumers.trainer.ledger import Ledger, TrainedEntry, check_consumer_name
from rollq.schemas import DecodeError
from rollq.schemas.decoding import decode_scored_columns

STATE_FORMAT = 1
"""The version of ``TrainerClient.state()``'s document."""


async def groups_to_replay(ledger: Ledger, run: str,
                           state: dict[str, Any]) -> tuple[list[HeldGroup], int | None]:
    """The groups ``state`` says were trained after its checkpoint (their training was
    lost), fetched and decoded in the order they were trained, and the policy version the
    state recorded. ``ResumeError`` when the state is for another run, malformed, or a group
    can no longer be found."""
    try:
        if state["format"] != STATE_FORMAT or state["run"] != run:
            raise ResumeError(f"state is for run {state['run']!r} (format "
                              f"{state['format']}), this client is {run!r}")
        consumer, log_id = str(state["consumer"]), str(state["log_id"])
        pending = [TrainedEntry(str(g), str(s), str(i)) for s, i, g in state["replay"]]
        version = state["policy_version"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ResumeError(f"malformed trainer state: {exc!r}") from exc
    entries = pending + await ledger.log_since(check_consumer_name(consumer), log_id)
    foreign = [e for e in entries
               if run_of_stream(e.stream) != run or not is_entry_id(e.entry_id)]
    if foreign:  # a damaged checkpoint: Redis would answer the lookup with an error
        raise ResumeError(f"{len(foreign)} groups to replay are not entries of run "
                          f"{run!r}'s streams (first: {foreign[0].stream[:80]!r} "
                          f"{foreign[0].entry_id[:40]!r})")
    unique: list[TrainedEntry] = []
    listed: set[str] = set()
    for entry in entries:  # a group listed twice (a retried ack) is replayed once
        if entry.group_id not in listed:
            listed.add(entry.group_id)
            unique.append(entry)
    fetched = await ledger.fetch(unique)
    missing = [(e, f) for e, f in zip(unique, fetched, strict=True) if isinstance(f, str)]
    if missing:
        first, why = missing[0]
        where = "traj" if why else "scored"  # "": the scored entry itself is gone
        raise ResumeError(
            f"{len(missing)} of {len(unique)} groups to replay were trimmed from the {where} "
            f"streams (first: {first.stream} {first.entry_id}{': ' + why if why else ''}); "
            "keep the trim retention longer than the checkpoint interval")
    held: list[HeldGroup] = []
    for entry, fields in zip(unique, fetched, strict=True):
        assert not isinstance(fields, str)
        try:
            group = decode_scored_columns(fields)
        except DecodeError as exc:
            raise ResumeError(f"entry {entry.entry_id} to replay: {exc}") from exc
        held.append(HeldGroup(Delivery(entry.stream, entry.entry_id, {}), group, replay=True))
    return held, None if version is None else int(version)
