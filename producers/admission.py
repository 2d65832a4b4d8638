"""Paced admission (DESIGN.md §4, AReaL's rule): how many new rollout jobs may start now.

The feeder admits a job only while

    (max_staleness + version + 1) * batch_groups - (consumed + in_flight + buffered) > 0

so generation never runs more than ``max_staleness`` policy versions ahead of the trainer.
Finished work is paced, not discarded: discarding stale groups biases training toward
prompts that are quick to answer.

``in_flight + buffered`` is what was admitted and has not yet been consumed or dropped:
``admitted - consumed - dropped`` (``outstanding``). rollq neither can nor needs to tell
the two apart (a group is "buffered" from its XADD until the trainer consumes it), so
``admit`` takes their sum. Drops (stale, degenerate, dead-lettered, failed jobs) free their
slot, except duplicates, which never held one.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollq.schemas.keys import CONSUMED_COUNTER, DROP_PREFIX

# A duplicate is an extra copy of an admitted group; it never took a slot of its own.
NOT_FREEING_SLOTS = frozenset({"duplicate"})


def admit(
    version: int,
    consumed: int,
    outstanding: int,
    *,
    max_staleness: int,
    batch_groups: int,
) -> int:
    """Number of new jobs that may be admitted now (never negative); ``outstanding`` is
    ``in_flight + buffered``: admitted and not yet consumed or dropped."""
    budget = (max_staleness + version + 1) * batch_groups
    return max(0, budget - (consumed + outstanding))


def outstanding(admitted: int, counters: Mapping[str, int]) -> tuple[int, int]:
    """``(consumed, in_flight + buffered)`` from the admitted count and the summed counters."""
    consumed = counters.get(CONSUMED_COUNTER, 0)
    dropped = sum(
        value
        for name, value in counters.items()
        if name.startswith(DROP_PREFIX) and name[len(DROP_PREFIX):] not in NOT_FREEING_SLOTS
    )
    return consumed, max(0, admitted - consumed - dropped)
