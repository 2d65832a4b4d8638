"""The n-gram repetition penalty (open-r1 over words, TRL over token ids)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

from pydantic import Field, field_validator

from rollq.consumers.scorer.components.base import ComponentSettings, RewardComponent
from rollq.consumers.scorer.sample import Sample


class RepetitionSettings(ComponentSettings):
    """Settings of `repetition`.

    - `ngram_size`: n, the n-gram length (in `unit`s).
    - `max_penalty`: the reward when every n-gram repeats (≤ 0; a positive value would
      reward repetition and is a configuration error).
    - `unit`: `words` (lower-cased whitespace-split words of the whole completion,
      open-r1) or `tokens` (the completion's token ids, TRL).
    """

    ngram_size: int = Field(default=3, ge=1)
    max_penalty: float = -1.0
    unit: Literal["words", "tokens"] = "words"

    @field_validator("max_penalty")
    @classmethod
    def _not_positive(cls, value: float) -> float:
        if value > 0:
            raise ValueError("max_penalty must be ≤ 0 (a positive value rewards repetition)")
        return value


class Repetition(RewardComponent[RepetitionSettings]):
    """Empty text or fewer units than n → 0; else `(1 - unique/total) · max_penalty`,
    over the completion's n-grams."""

    settings_model = RepetitionSettings

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        size = self.settings.ngram_size
        units: Sequence[Hashable]
        if self.settings.unit == "words":
            units = sample.full_text().lower().split()
        else:
            units = sample.completion_ids.tolist()
        if len(units) < size:
            return 0.0
        ngrams = [tuple(units[index:index + size]) for index in range(len(units) - size + 1)]
        scaling = 1.0 - len(set(ngrams)) / len(ngrams)
        return scaling * self.settings.max_penalty
