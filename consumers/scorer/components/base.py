"""The reward-component interface: settings model, placement, and the score call."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Generic, Literal, TypeVar

import httpx
import numpy as np
from numpy.typing import NDArray
from pydantic import AfterValidator, BaseModel, ConfigDict

from rollq.consumers.scorer.sample import Sample


def _compiles(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:  # not a ValueError: pydantic would let it escape unreported
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
    return pattern


Regex = Annotated[str, AfterValidator(_compiles)]
"""A setting holding a regular expression; one that does not compile is a config error."""

Placement = Literal["inline", "process", "async"]
"""Where the bridge runs a component: on the event loop (cheap, pure Python), in the
process pool (CPU-heavy, e.g. sympy; must be picklable), or awaited (I/O, e.g. HTTP)."""

Population = Literal["group", "batch"]
"""What a component's `group` argument holds: the sample's own group, or every sample
handed to the bridge in one `score_batch` call."""


class ComponentSettings(BaseModel):
    """Base of every component's settings: frozen, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Score:
    """A component's result for one completion.

    - `value`: the scalar reward, or None for "skip" (the bridge keeps None as the raw
      value and adds nothing to the total).
    - `token_rewards`: optional per-token rewards (float32, one per completion token).
    - `step_ends`: token index of the last token of each step (process rewards).
    - `step_scores`: the score of each step, aligned with `step_ends`.
    """

    value: float | None
    token_rewards: NDArray[np.float32] | None = None
    step_ends: NDArray[np.int64] | None = None
    step_scores: NDArray[np.float32] | None = None


SettingsT = TypeVar("SettingsT", bound=ComponentSettings)


class RewardComponent(Generic[SettingsT]):
    """A named reward: constructed from its settings, it scores one completion at a time.

    Subclasses set `settings_model` and implement `score`. They may override:

    - `placement` (default `inline`): `process` runs `evaluate` in the bridge's process
      pool with the entry's timeout; `async` awaits `evaluate_async` with it.
    - `uses_group` (default False): when False the bridge may pass an empty `group` to
      pool workers, to avoid pickling the whole group for every sample.
    - `needs_correctness` (default False): when True the bridge runs the correctness
      component first and sets `Sample.correct` before calling this one.
    - `preload_modules`: modules a pool worker imports at start-up, before its first call
      (e.g. `math_verify`), so the first call's timeout does not pay for the import.
    - `required_fields()`: metadata fields that must be present for the group to be
      scored at all (checked by the bridge before any component runs).
    """

    settings_model: ClassVar[type[ComponentSettings]] = ComponentSettings
    preload_modules: ClassVar[tuple[str, ...]] = ()
    uses_group: ClassVar[bool] = False
    needs_correctness: ClassVar[bool] = False

    def __init__(self, settings: SettingsT) -> None:
        self.settings = settings

    @property
    def placement(self) -> Placement:
        return "inline"

    @property
    def population(self) -> Population:
        return "group"

    def required_fields(self) -> tuple[str, ...]:
        return ()

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        """The reward for `sample`; `group` is its population (see `Population`)."""
        raise NotImplementedError

    def evaluate(self, sample: Sample, group: Sequence[Sample]) -> Score:
        """`score` wrapped in a `Score`; components with token-level output override this."""
        return Score(self.score(sample, group))

    async def evaluate_async(self, sample: Sample, group: Sequence[Sample]) -> Score:
        """The awaited form, for `async` components; defaults to `evaluate`."""
        return self.evaluate(sample, group)

    async def open(self, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Acquire I/O resources (e.g. an HTTP client); `transport` is for tests."""

    async def close(self) -> None:
        """Release what `open` acquired."""
