"""The reasoning-steps reward (open-r1): counts step-like markers in the completion."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property

from pydantic import Field

from rollq.consumers.scorer.components.base import ComponentSettings, Regex, RewardComponent
from rollq.consumers.scorer.sample import Sample


class ReasoningStepsSettings(ComponentSettings):
    """Settings of `reasoning_steps`: `pattern` (a regex, compiled without flags, counted
    with `findall` over the whole completion) and `target` (the count worth 1.0)."""

    pattern: Regex = r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)"
    target: int = Field(default=3, ge=1)


class ReasoningSteps(RewardComponent[ReasoningStepsSettings]):
    """`min(1, n / target)`, n = the pattern's matches."""

    settings_model = ReasoningStepsSettings

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.settings.pattern)

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        count = len(self.regex.findall(sample.full_text()))
        return min(1.0, count / self.settings.target)
