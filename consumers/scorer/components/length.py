"""Length-shaped rewards: ROLL's bounty, DAPO's soft overlong penalty, Kimi 1.5's cosine
scaling and Kimi's group length reward."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from rollq.consumers.scorer.components.base import (
    ComponentSettings,
    Population,
    RewardComponent,
)
from rollq.consumers.scorer.sample import LengthUnit, Sample


class LengthBountySettings(ComponentSettings):
    """Settings of `length_bounty` (ROLL): `scale` (length units per 1.0 of reward),
    `max` (the cap), `unit` (`chars` or `tokens`)."""

    scale: float = Field(default=1000.0, gt=0)
    max: float = 0.2
    unit: LengthUnit = "chars"


class LengthBounty(RewardComponent[LengthBountySettings]):
    """`min(length / scale, max)`."""

    settings_model = LengthBountySettings

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        settings = self.settings
        return min(sample.length(settings.unit) / settings.scale, settings.max)


class SoftOverlongSettings(ComponentSettings):
    """Settings of `soft_overlong` (DAPO): `max_completion_len` (Lmax, tokens) and `cache`
    (C, tokens: the width of the linear penalty ramp before Lmax; 0 < C ≤ Lmax)."""

    max_completion_len: int = Field(gt=0)
    cache: int = Field(gt=0)

    @model_validator(mode="after")
    def _cache_fits(self) -> SoftOverlongSettings:
        if self.cache > self.max_completion_len:
            raise ValueError("'cache' must not exceed 'max_completion_len'")
        return self


class SoftOverlong(RewardComponent[SoftOverlongSettings]):
    """L = completion tokens: `L ≤ Lmax - C` → 0; `Lmax - C < L ≤ Lmax` → `(Lmax - C - L)/C`;
    `L > Lmax` → -1."""

    settings_model = SoftOverlongSettings

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        limit, cache = self.settings.max_completion_len, self.settings.cache
        length = len(sample.completion_ids)
        if length <= limit - cache:
            return 0.0
        if length <= limit:
            return (limit - cache - length) / cache
        return -1.0


class CosineSettings(ComponentSettings):
    """Settings of `cosine` (Kimi 1.5 cosine-scaled length reward; open-r1 defaults).

    - `min_wrong`, `max_wrong`: a wrong answer of length 0 gets `min_wrong`, rising to
      `max_wrong` at `max_len` (long wrong answers are penalised less: keep exploring).
    - `min_correct`, `max_correct`: a correct answer of length 0 gets `max_correct`,
      falling to `min_correct` at `max_len` (short correct answers are preferred).
    - `max_len`: the length at which the cosine reaches its end, in `unit`.
    - `unit`: `chars` (open-r1) or `tokens`.
    - `clamp`: clamp p = length/max_len to 1 (TRL) or not (open-r1, the default: past
      `max_len` the cosine rises again).

    Correctness comes from the correctness component; unknown correctness → None.
    """

    min_wrong: float = -1.0
    max_wrong: float = -0.5
    min_correct: float = 0.5
    max_correct: float = 1.0
    max_len: float = Field(default=1000.0, gt=0)
    unit: LengthUnit = "chars"
    clamp: bool = False


class Cosine(RewardComponent[CosineSettings]):
    """`lo + 0.5·(hi - lo)·(1 + cos(π·p))`; correct: lo, hi = min_correct, max_correct;
    wrong: lo, hi = max_wrong, min_wrong."""

    settings_model = CosineSettings
    needs_correctness = True

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        settings = self.settings
        if sample.correct is None:
            return None
        progress = sample.length(settings.unit) / settings.max_len
        if settings.clamp:
            progress = min(progress, 1.0)
        if sample.correct:
            low, high = settings.min_correct, settings.max_correct
        else:
            low, high = settings.max_wrong, settings.min_wrong
        return low + 0.5 * (high - low) * (1.0 + math.cos(math.pi * progress))


class KimiLengthSettings(ComponentSettings):
    """Settings of `length` (Kimi len_reward): `unit` (`chars` as open-r1, or `tokens`)
    and `scope`: `group` (min/max over the sample's group, the rollq default) or `batch`
    (over every sample handed to one `score_batch` call, as open-r1 normalises over its
    batch)."""

    unit: LengthUnit = "chars"
    scope: Literal["group", "batch"] = "group"


class KimiLength(RewardComponent[KimiLengthSettings]):
    """Over the completions in scope: max_len == min_len → 0 for all; else
    λ = 0.5 - (L - minL)/(maxL - minL); correct → λ, wrong → min(0, λ); unknown
    correctness → None."""

    settings_model = KimiLengthSettings
    needs_correctness = True
    uses_group = True

    @property
    def population(self) -> Population:
        return self.settings.scope

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        if sample.correct is None:
            return None
        unit = self.settings.unit
        lengths = [member.length(unit) for member in group] or [sample.length(unit)]
        shortest, longest = min(lengths), max(lengths)
        if longest == shortest:
            return 0.0
        reward = 0.5 - (sample.length(unit) - shortest) / (longest - shortest)
        return reward if sample.correct else min(0.0, reward)
