"""The trainer SDK's own errors, both direct branches of ``RollqError``.

Neither maps to a delivery action on a stream entry (the trainer decides what to do):

- ``WeightSyncError``: one or more inference servers failed a step of a weight update.
  It is not a ``TransientError``: a server that is down may recover, but a bad weights
  directory will not, so blind retrying is wrong. The policy version was NOT bumped; fix
  the cause and call ``publish_policy`` again (every step is idempotent), or stop.
- ``ResumeError``: a saved state cannot be honoured without skipping or repeating groups
  (wrong run, malformed, or the entries to replay were trimmed away). Raised by
  ``load_state`` before anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollq.schemas import RollqError


class WeightSyncError(RollqError):
    """Some inference servers did not complete a weight update.

    ``failures`` maps each failed server's base URL to what went wrong (the step and the
    reason). Every server that had been paused was asked to resume before this was raised.
    """

    def __init__(self, step: int, failures: Mapping[str, str]) -> None:
        self.step = step
        self.failures = dict(failures)
        listed = "; ".join(f"{url}: {why}" for url, why in self.failures.items())
        super().__init__(
            f"weight update to step {step} failed on {len(self.failures)} server(s): {listed}"
        )


class ResumeError(RollqError):
    """A checkpointed trainer state cannot be resumed exactly-once."""
