"""The character-fraction reward: a dense toy reward for smoke tests and the local demo.

Real tasks want `accuracy`; but a tiny randomly initialised model almost never answers a
question, so its accuracy is 0 for every sample and GRPO has no signal. The fraction of
characters of a class (digits, by default) rises smoothly as the policy shifts probability
towards those tokens, which makes learning visible within a few dozen steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property

from rollq.consumers.scorer.components.base import ComponentSettings, Regex, RewardComponent
from rollq.consumers.scorer.sample import Sample


class CharFractionSettings(ComponentSettings):
    """Settings of `char_fraction`: `pattern`, a regex matched against each character
    (default `[0-9]`)."""

    pattern: Regex = "[0-9]"


class CharFraction(RewardComponent[CharFractionSettings]):
    """Matching characters / all characters of the completion text, in [0, 1]; 0 when the
    text is empty."""

    settings_model = CharFractionSettings

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.settings.pattern)

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        text = sample.text
        if not text:
            return 0.0
        return sum(1 for char in text if self.regex.fullmatch(char)) / len(text)
