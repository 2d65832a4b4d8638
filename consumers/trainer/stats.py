"""``TrainerStats``: what one ``TrainerClient`` did, for the trainer's metrics.

Plain numbers kept in memory (``TrainerClient.stats``); ``ops.role_metrics`` exposes them to
Prometheus when a trainer serves ``/metrics``. The step is what the SDK can see of it: from
``next_batch`` returning a batch to that batch's ``ack`` (forward, backward, optimizer).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from rollq.schemas.columns import ScoredColumns
from rollq.schemas.stats import VERSION_BOUNDS, Histogram

if TYPE_CHECKING:
    from rollq.consumers.trainer.weights import SyncReport

SYNC_METHODS = ("reload", "transfer", "external", "lora")
ABORT_BOUNDS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
"""Buckets for requests aborted by one weight sync."""


class TrainerStats:
    """Counts and distributions of one client's batches."""

    def __init__(self) -> None:
        self.batches = 0
        """Batches acked."""
        self.groups = 0
        """Groups in acked batches (replays after a resume included)."""
        self.consumed = 0
        """Entries counted ``consumed`` by this client's acks (the run-wide counter's
        share of this client)."""
        self.tokens = 0
        """Prompt + completion tokens of the groups in acked batches."""
        self.wait_seconds = Histogram()
        """Time spent inside ``next_batch`` per batch returned (waiting for groups)."""
        self.step_seconds = Histogram()
        """From a batch handed out to its ``ack``: the training step."""
        self.staleness = Histogram(VERSION_BOUNDS)
        """Per acked group: the policy version at ``next_batch`` minus the group's."""
        self.sync_seconds = {method: Histogram() for method in SYNC_METHODS}
        """Per weight-sync method: each successful sync's duration (``publish_policy``)."""
        self.paused_seconds = {method: Histogram() for method in SYNC_METHODS}
        """Per method: how long generation was paused by each successful sync."""
        self.sync_bytes = dict.fromkeys(SYNC_METHODS, 0)
        """Per method: weight bytes the trainer sent (transfer)."""
        self.sync_aborts = {method: Histogram(ABORT_BOUNDS) for method in SYNC_METHODS}
        """Per method: requests the servers aborted during each sync (where they said)."""
        # a batch's entries (the sync facade acks a copy of the batch) -> (handed, version)
        self._handed: dict[Hashable, tuple[float, int]] = {}

    def handed_out(self, entries: Hashable, version: int, waited_s: float) -> None:
        """``next_batch`` returned the batch of ``entries`` after ``waited_s``, at
        ``version``."""
        self.wait_seconds.observe(waited_s)
        self._handed[entries] = (time.monotonic(), version)
        if len(self._handed) > 64:  # batches never acked (dropped by the caller)
            del self._handed[next(iter(self._handed))]

    def acked(self, entries: Hashable, groups: Sequence[ScoredColumns], consumed: int) -> None:
        """The batch of ``entries`` was acked; ``consumed`` of it counted by this ack."""
        handed = self._handed.pop(entries, None)
        if handed is not None:
            started, version = handed
            self.step_seconds.observe(time.monotonic() - started)
            for group in groups:
                self.staleness.observe(max(0, version - group.policy_version))
        self.batches += 1
        self.groups += len(groups)
        self.consumed += consumed
        self.tokens += sum(g.sequence_tokens for g in groups)

    def synced(self, report: SyncReport) -> None:
        """A weight sync succeeded."""
        method = report.method
        self.sync_seconds[method].observe(report.seconds)
        self.paused_seconds[method].observe(report.paused_seconds)
        self.sync_bytes[method] += report.bytes_moved
        if report.aborted_requests is not None:
            self.sync_aborts[method].observe(report.aborted_requests)
