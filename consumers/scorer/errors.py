"""The scorer's errors, as branches of rollq's one exception tree (`schemas.errors`).

- `RewardConfigError`: the reward configuration is invalid. Raised at start-up, before any entry
  is read; the message names the offending field.
- `ScoringError`: a group could not be scored: a component under `on_error: dead_letter`
  still failed (raised, timed out, lost its pool process) after its in-process retries —
  the reward is unknown, so the scorer retries the group and then dead-letters it as
  `reward_error` (`schemas.failures`) — or it cannot be scored at all
  (`MissingFieldError`: the env's metadata lacks a field a component needs; dead-lettered
  at once as `reward_missing_field`).
"""

from __future__ import annotations

from rollq.schemas.errors import ConfigError as _RollqConfigError
from rollq.schemas.errors import RewardError as _RollqRewardError


class RewardConfigError(_RollqConfigError):
    """The reward configuration is invalid; the message names the offending field."""


class ScoringError(_RollqRewardError):
    """A group could not be scored (see the module docstring for what happens to it).

    `reason` is a short tag (`"error"`, `"timeout"`, `"worker_died"`, `"missing_field"`);
    `component` names the configured component, if one is to blame.
    """

    def __init__(self, reason: str, message: str, *, component: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.component = component


class MissingFieldError(ScoringError):
    """The group's metadata lacks a field a configured component needs (e.g. the gold)."""

    def __init__(self, field: str, *, component: str) -> None:
        super().__init__(
            "missing_field",
            f"component {component!r} needs metadata field {field!r}, "
            "which the group's metadata does not have",
            component=component,
        )
        self.field = field
