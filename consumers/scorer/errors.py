"""The scorer's errors, as branches of rollq's one exception tree (`schemas.errors`).

- `ConfigError`: the reward configuration is invalid. Raised at start-up, before any entry
  is read; the message names the offending field.
- `RewardError`: a group could not be scored under the `dead_letter` policy (a component
  raised or timed out), or cannot be scored at all (`MissingFieldError`: the env's metadata
  lacks a field a component needs). The consumer dead-letters the group: retrying the same
  entry would fail the same way.
"""

from __future__ import annotations

from schemas.errors import ConfigError as _RollqConfigError
from schemas.errors import RewardError as _RollqRewardError


class ConfigError(_RollqConfigError):
    """The reward configuration is invalid; the message names the offending field."""


class RewardError(_RollqRewardError):
    """A group could not be scored; the consumer dead-letters it.

    `reason` is a short countable tag (`"error"`, `"timeout"`, `"missing_field"`);
    `component` names the configured component, if one is to blame.
    """

    def __init__(self, reason: str, message: str, *, component: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.component = component


class MissingFieldError(RewardError):
    """The group's metadata lacks a field a configured component needs (e.g. the gold)."""

    def __init__(self, field: str, *, component: str) -> None:
        super().__init__(
            "missing_field",
            f"component {component!r} needs metadata field {field!r}, "
            "which the group's metadata does not have",
            component=component,
        )
        self.field = field
