"""What ``next_batch`` returns: the groups, their arrays in the padded layout, and ``ack``.

``Batch`` (async ``ack``) and ``SyncBatch`` (blocking ``ack``, from the sync facade) share
everything else through ``BatchData``. Array alignment is documented in
``consumers.trainer.layout``: per-token arrays describe the tokens themselves; use
``targets()`` for the one-place shift a causal LM needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from rollq.consumers.trainer.layout import (
    Group,
    PackedBatch,
    PaddedArrays,
    array_fields,
    arrays_to_torch,
    pack_groups,
    pad_groups,
)
from rollq.schemas import ScoredGroup
from rollq.schemas.columns import ScoredColumns
from rollq.schemas.models import SamplingRecord


@dataclass(frozen=True)
class EntryRef:
    """Where a group came from: its scored stream key and entry id."""

    stream: str
    entry_id: str


@dataclass(frozen=True, eq=False)
class BatchData(PaddedArrays):
    """Whole scored groups and their padded arrays (B sequences, T tokens; see
    ``PaddedArrays`` for every array). Sequences are in group order, each group's
    completions in order; ``group_index[i]`` says which group sequence ``i`` belongs to."""

    sources: tuple[Group, ...]
    """What the arrays were laid out from, a group each: the decoded columns of its entry
    (``schemas.columns``; what ``next_batch`` gives) or the ``ScoredGroup`` itself."""
    entries: tuple[EntryRef, ...]
    """The stream entry of each group, in ``groups`` order."""

    @property
    def groups(self) -> tuple[ScoredGroup, ...]:
        """The scored groups of the batch, whole (rewards, component values, text,
        metadata). Their models are assembled on the first read, from values already
        checked when the entries were decoded; a training step that uses only the arrays
        never pays for them."""
        return tuple(g if isinstance(g, ScoredGroup) else g.group() for g in self.sources)

    @property
    def sampling(self) -> tuple[SamplingRecord | None, ...]:
        """How each sequence was sampled (temperature, top_p, top_k, min_p, the server's
        logprobs mode, the model served), in sequence order; None where the producer did
        not record it. ``consumers.trainer.correction`` reads it."""
        return tuple(record for source in self.sources for record in (
            source.trajectory.sampling() if isinstance(source, ScoredColumns)
            else [c.sampling for c in source.trajectory.completions]))

    @property
    def routed_experts(self) -> tuple[Any, ...]:
        """Routing replay: per sequence, the experts the MoE sampler routed each position to,
        ``[length - 1, layers, top_k]`` (position ``t`` of ``input_ids[i]``: the forward
        that predicted token ``t + 1``), or None where the entry carries none (off by
        default: the workers' ``routed_experts`` setting)."""
        found: list[Any] = []
        for source in self.sources:
            if isinstance(source, ScoredColumns):
                found += source.trajectory.routed_experts or [None] * source.num_sequences
            else:
                found += [c.routed_experts for c in source.trajectory.completions]
        return tuple(found)

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.sources]

    @property
    def entry_ids(self) -> list[str]:
        return [e.entry_id for e in self.entries]

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens, prompts included."""
        return int(self.lengths.sum())

    def __len__(self) -> int:
        """Number of groups."""
        return len(self.sources)

    def pack(self) -> PackedBatch:
        """The same sequences in the packed layout (flat tokens + ``cu_seqlens``)."""
        return pack_groups(self.sources)

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The padded arrays as torch tensors by name (on ``device`` if given).

        torch is imported only here; ImportError with a hint when it is not installed.
        """
        arrays = array_fields(self)
        return arrays_to_torch(arrays, device)

    def data(self) -> dict[str, Any]:
        """Every ``BatchData`` field by name (to rebuild the batch in another class)."""
        return {f.name: getattr(self, f.name) for f in fields(BatchData)}


class AsyncAcker(Protocol):
    async def ack(self, batch: BatchData) -> int: ...


class SyncAcker(Protocol):
    def ack(self, batch: BatchData) -> int: ...


@dataclass(frozen=True, eq=False)
class Batch(BatchData):
    """A batch from ``TrainerClient.next_batch``; ``await batch.ack()`` after the step."""

    acker: AsyncAcker = field(repr=False, kw_only=True)

    async def ack(self) -> int:
        """Acknowledge every group: they are trained. Call after the optimizer step.

        Records the groups as trained (dedup and resume), then acks and counts them under
        ``consumed`` atomically per entry. Returns how many entries this call counted;
        acking twice is harmless (the second call returns 0).
        """
        return await self.acker.ack(self)


@dataclass(frozen=True, eq=False)
class SyncBatch(BatchData):
    """A batch from ``SyncTrainerClient.next_batch``; ``batch.ack()`` after the step."""

    acker: SyncAcker = field(repr=False, kw_only=True)

    def ack(self) -> int:
        """Blocking ``Batch.ack``."""
        return self.acker.ack(self)


def build_batch(
    groups: list[Group], entries: list[EntryRef], acker: AsyncAcker, pad_token_id: int
) -> Batch:
    """A ``Batch`` of ``groups`` (with their stream entries) acked through ``acker``."""
    padded = pad_groups(groups, pad_token_id)
    arrays = {f.name: getattr(padded, f.name) for f in fields(PaddedArrays)}
    return Batch(**arrays, sources=tuple(groups), entries=tuple(entries), acker=acker)
