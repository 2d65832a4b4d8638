"""Custom components referenced by dotted path from the bridge tests (importable by name,
so spawned pool workers can load them)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from consumers.scorer import ComponentSettings, RewardComponent, Sample
from consumers.scorer.components import Placement


class ScaledLengthSettings(ComponentSettings):
    """`factor`: reward per character."""

    factor: float = 1.0


class ScaledLength(RewardComponent[ScaledLengthSettings]):
    """factor · len(text); runs inline."""

    settings_model = ScaledLengthSettings

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        return self.settings.factor * len(sample.text)


class NapSettings(ComponentSettings):
    """`seconds`: how long to sleep when the text contains "nap" (forever: `spin`)."""

    seconds: float = 0.0
    spin: bool = False


class Nap(RewardComponent[NapSettings]):
    """Sleeps (or busy-loops forever) in a pool worker on texts containing "nap", then
    returns len(text)."""

    settings_model = NapSettings

    @property
    def placement(self) -> Placement:
        return "process"

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        if "nap" in sample.text:
            if self.settings.spin:
                while True:
                    pass
            time.sleep(self.settings.seconds)
        return float(len(sample.text))


class Boom(RewardComponent[ComponentSettings]):
    """Raises on texts containing "boom", else 1.0."""

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        if "boom" in sample.text:
            raise RuntimeError("boom")
        return 1.0
