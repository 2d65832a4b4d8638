"""The consume-time staleness rule (DESIGN.md §4), a pure function with table tests."""

from __future__ import annotations


def is_stale(group_version: int, current_version: int, max_staleness: int | None) -> bool:
    """Whether a group generated under ``group_version`` is too old to train on.

    A group is stale when ``group_version < current_version - max_staleness``: with
    ``max_staleness=1`` a trainer at version 5 still takes groups of versions 4 and 5 (and
    newer ones, which appear after a resume from an older checkpoint), and rejects 3.
    ``max_staleness=None`` disables the check; ``0`` accepts only the current version.
    """
    if max_staleness is None:
        return False
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
    return group_version < current_version - max_staleness
