"""The env's own score as a reward component: what an Atropos env (or any env that scores
its own groups) posted, so the bridge can add format, length or process rewards on top.

The Atropos API (``rollq atropos-api --rewards bridge``) keeps each sequence's posted score
in ``completions[i].info["env_score"]``; a rollq env may put it there, or in the group's
metadata, under the same name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rollq.consumers.scorer.components.base import ComponentSettings, RewardComponent
from rollq.consumers.scorer.sample import Sample


class EnvScoreSettings(ComponentSettings):
    """Settings of `env_score`: `field`, the per-completion (then per-group) metadata field
    holding the score (default `env_score`)."""

    field: str = "env_score"


class EnvScore(RewardComponent[EnvScoreSettings]):
    """The env's score of the completion, unchanged (a float, in the env's own units);
    None (skipped) when the completion has none, or it is not a finite number."""

    settings_model = EnvScoreSettings

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        try:
            value = sample.lookup(self.settings.field)
        except KeyError:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None
