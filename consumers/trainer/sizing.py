"""Batch sizing: how many queued groups make the next batch. A pure rule, table-tested."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSize:
    """Limits of one batch; None means no limit of that kind. Groups are never split."""

    groups: int | None = None
    """Exactly this many groups make a full batch."""
    sequences: int | None = None
    """Whole groups are added while the sequence total stays <= this."""
    max_tokens: int | None = None
    """Whole groups are added while prompt+completion tokens stay <= this."""

    @classmethod
    def of(cls, groups: int | None, sequences: int | None, max_tokens: int | None,
           default_groups: int) -> BatchSize:
        """Validate the limits ``next_batch`` was given; ``default_groups`` when none."""
        for name, value in (("groups", groups), ("sequences", sequences),
                            ("max_tokens", max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if groups is None and sequences is None and max_tokens is None:
            groups = default_groups
        return cls(groups, sequences, max_tokens)

    def fit(self, queued: Sequence[tuple[int, int]]) -> tuple[int, bool]:
        """How many of the queued groups (``(sequences, tokens)`` each, in order) go into
        the batch, and whether the batch is full.

        Groups are taken in order; the first group that would break a limit ends the batch
        (it waits for the next one), except that a batch always takes its first group. A
        batch is also full when a limit is met exactly.
        """
        taken = sequences = tokens = 0
        for group_sequences, group_tokens in queued:
            over = (
                (self.sequences is not None and sequences + group_sequences > self.sequences)
                or (self.max_tokens is not None and tokens + group_tokens > self.max_tokens)
            )
            if over and taken:
                return taken, True
            taken, sequences, tokens = (taken + 1, sequences + group_sequences,
                                        tokens + group_tokens)
            if (
                (self.groups is not None and taken >= self.groups)
                or (self.sequences is not None and sequences >= self.sequences)
                or (self.max_tokens is not None and tokens >= self.max_tokens)
            ):
                return taken, True
        return taken, False
