"""Custom components referenced by dotted path from the bridge tests (importable by name,
so spawned pool workers can load them)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from rollq.consumers.scorer import ComponentSettings, RewardComponent, Sample
from rollq.consumers.scorer.components import Placement


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


class FlakySettings(ComponentSettings):
    """`failures`: how many calls per text raise before the component answers."""

    failures: int = 1


class Flaky(RewardComponent[FlakySettings]):
    """Raises on a text's first `failures` calls (in this instance), then 1.0."""

    settings_model = FlakySettings

    def __init__(self, settings: FlakySettings) -> None:
        super().__init__(settings)
        self.calls: dict[str, int] = {}

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        self.calls[sample.text] = self.calls.get(sample.text, 0) + 1
        if self.calls[sample.text] <= self.settings.failures:
            raise ConnectionError("flaky dependency")
        return 1.0


class NapOnceSettings(ComponentSettings):
    """`marker`: a file path; the first call on a "nap" text writes the worker's pid there
    and sleeps `seconds`; later calls (the file exists) answer at once."""

    marker: str
    seconds: float = 60.0


class NapOnce(RewardComponent[NapOnceSettings]):
    """In a pool worker: naps once (so a test can kill the worker mid-call), then len(text)."""

    settings_model = NapOnceSettings

    @property
    def placement(self) -> Placement:
        return "process"

    def score(self, sample: Sample, group: Sequence[Sample]) -> float:
        marker = Path(self.settings.marker)
        if "nap" in sample.text and not marker.exists():
            partial = marker.with_suffix(".partial")
            partial.write_text(str(os.getpid()))
            partial.rename(marker)  # the test never reads a half-written pid
            time.sleep(self.settings.seconds)
        return float(len(sample.text))
