"""Step-wise process rewards: segment the reasoning into steps, score each step (env labels
or a process reward model over HTTP), and place the step scores on tokens.

PRM protocol (one request per completion)::

    POST <prm.url>   {"prompt": "<prompt text>", "steps": ["<step 1>", "<step 2>", ...]}
    200              {"scores": [0.9, 0.2, ...]}      # one float per step, same order

Any other status, a body that is not that shape, a score count that differs from the
step count, or a transport error is a component error (the entry's `on_error` applies).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import httpx
import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from rollq.consumers.scorer.components.base import (
    ComponentSettings,
    Placement,
    RewardComponent,
    Score,
)
from rollq.consumers.scorer.errors import ScoringError
from rollq.consumers.scorer.sample import Sample

_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")


class PrmSettings(ComponentSettings):
    """The process reward model endpoint: `url` (full URL of the POST) and `timeout_s`
    (seconds, per request; the entry's `timeout_s` still bounds the whole call)."""

    url: str = Field(min_length=1)
    timeout_s: float = Field(default=30.0, gt=0)


class ProcessSettings(ComponentSettings):
    """Settings of `process`.

    - `segmenter`: `newline_blocks` (steps are blocks separated by blank lines),
      `step_markers` (a step starts at each `marker_pattern` match; text before the first
      marker is not a step), or `env_spans` (char spans `[start, end)` into `Sample.text`
      from metadata field `spans_field`, per completion first).
    - `region`: segment the `reasoning` (the trace's blocks) or the whole completion
      (`anywhere`). Steps never cross reasoning blocks.
    - `source`: `labels` (one score per step from metadata field `labels_field`) or `prm`
      (the model at `prm.url`, see the module docstring).
    - `aggregate`: the scalar value: `min`, `mean` or `last` of the step scores.
    - `placement`: per-token rewards carry each step score on the step's `last_token`, or
      `spread` it evenly over the step's tokens (the step's tokens sum to its score).

    Char positions map to tokens through `Sample.token_offsets` when given, else
    proportionally (`token = ⌊char · n_tokens / n_chars⌋`). No steps → value None.
    """

    segmenter: Literal["newline_blocks", "step_markers", "env_spans"] = "newline_blocks"
    marker_pattern: str = r"Step \d+:"
    spans_field: str = "step_spans"
    region: Literal["reasoning", "anywhere"] = "reasoning"
    source: Literal["labels", "prm"] = "labels"
    labels_field: str = "step_labels"
    prm: PrmSettings | None = None
    aggregate: Literal["min", "mean", "last"] = "min"
    placement: Literal["last_token", "spread"] = "last_token"

    @model_validator(mode="after")
    def _prm_configured(self) -> ProcessSettings:
        if self.source == "prm" and self.prm is None:
            raise ValueError("source 'prm' needs the 'prm' settings (url)")
        re.compile(self.marker_pattern)
        return self


def _stripped(text: str, start: int, end: int) -> tuple[int, int] | None:
    piece = text[start:end]
    if not piece.strip():
        return None
    start += len(piece) - len(piece.lstrip())
    end -= len(piece) - len(piece.rstrip())
    return start, end


def segment_steps(
    text: str, regions: Sequence[tuple[int, int]], segmenter: str, marker_pattern: str
) -> list[tuple[int, int]]:
    """Char spans of the steps of `text` inside each region, whitespace-trimmed."""
    cuts: list[tuple[int, int]] = []
    for region_start, region_end in regions:
        if segmenter == "newline_blocks":
            bounds = [region_start]
            for match in _BLANK_LINES.finditer(text, region_start, region_end):
                bounds += [match.start(), match.end()]
            bounds.append(region_end)
            cuts += [(bounds[i], bounds[i + 1]) for i in range(0, len(bounds), 2)]
        else:
            starts = [m.start() for m in
                      re.compile(marker_pattern).finditer(text, region_start, region_end)]
            cuts += list(zip(starts, [*starts[1:], region_end], strict=True))
    return [span for start, end in cuts if (span := _stripped(text, start, end))]


def chars_to_tokens(sample: Sample, positions: NDArray[np.int64]) -> NDArray[np.int64]:
    """Token index holding each char position of `sample.full_text()`."""
    count = len(sample.completion_ids)
    if sample.token_offsets is not None:
        index = np.searchsorted(sample.token_offsets, positions, side="right") - 1
    else:
        index = positions * count // max(len(sample.full_text()), 1)
    return np.clip(index, 0, max(count - 1, 0)).astype(np.int64)


def place_step_scores(
    length: int, firsts: NDArray[np.int64], lasts: NDArray[np.int64],
    scores: NDArray[np.float32], placement: str,
) -> NDArray[np.float32]:
    """The per-token reward array of a completion of `length` tokens."""
    rewards = np.zeros(length, dtype=np.float32)
    for first, last, value in zip(firsts, lasts, scores, strict=True):
        if placement == "spread":
            rewards[first:last + 1] += value / (last - first + 1)
        else:
            rewards[last] += value
    return rewards


class ProcessReward(RewardComponent[ProcessSettings]):
    """Step-scored reward with per-token output (see `ProcessSettings`)."""

    settings_model = ProcessSettings

    def __init__(self, settings: ProcessSettings) -> None:
        super().__init__(settings)
        self._client: httpx.AsyncClient | None = None

    @property
    def placement(self) -> Placement:
        return "async" if self.settings.source == "prm" else "inline"

    def required_fields(self) -> tuple[str, ...]:
        return (self.settings.labels_field,) if self.settings.source == "labels" else ()

    def steps(self, sample: Sample) -> list[tuple[int, int]]:
        """Char spans of `sample`'s steps in `sample.full_text()`."""
        settings = self.settings
        text = sample.full_text()
        if settings.segmenter == "env_spans":
            shift = len(text) - len(sample.text)
            spans = sample.lookup(settings.spans_field)
            return [(int(start) + shift, int(end) + shift) for start, end in spans]
        trace = sample.trace
        if settings.region == "anywhere":
            regions: Sequence[tuple[int, int]] = [(0, len(text))]
        elif trace.source == "server_field":
            regions = [(0, len(trace.reasoning))]
        else:
            regions = trace.blocks
        return segment_steps(text, regions, settings.segmenter, settings.marker_pattern)

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        return self.evaluate(sample, group).value

    def evaluate(self, sample: Sample, group: Sequence[Sample]) -> Score:
        spans = self.steps(sample)
        labels = [float(label) for label in sample.lookup(self.settings.labels_field)]
        if len(labels) != len(spans):
            raise ValueError(f"{len(labels)} step labels for {len(spans)} steps")
        return self.build(sample, spans, labels)

    async def evaluate_async(self, sample: Sample, group: Sequence[Sample]) -> Score:
        if self.settings.source == "labels":
            return self.evaluate(sample, group)
        spans = self.steps(sample)
        if not spans:
            return self.build(sample, spans, [])
        text = sample.full_text()
        scores = await self._ask_prm(sample.prompt, [text[start:end] for start, end in spans])
        return self.build(sample, spans, scores)

    def build(self, sample: Sample, spans: list[tuple[int, int]], scores: list[float]) -> Score:
        """The `Score` for `spans` scored `scores`: aggregate, token rewards, step ends."""
        length = len(sample.completion_ids)
        if not spans or length == 0:
            empty = np.zeros(0, dtype=np.int64)
            return Score(None, np.zeros(length, dtype=np.float32), empty,
                         np.zeros(0, dtype=np.float32))
        bounds = np.array(spans, dtype=np.int64)
        firsts = chars_to_tokens(sample, bounds[:, 0])
        lasts = np.maximum(chars_to_tokens(sample, bounds[:, 1] - 1), firsts)
        values = np.asarray(scores, dtype=np.float32)
        aggregate = self.settings.aggregate
        if aggregate == "min":
            value = float(min(scores))
        elif aggregate == "mean":
            value = float(sum(scores) / len(scores))
        else:
            value = float(scores[-1])
        tokens = place_step_scores(length, firsts, lasts, values, self.settings.placement)
        return Score(value, tokens, lasts, values)

    async def open(self, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if self.settings.prm is not None:
            self._client = httpx.AsyncClient(timeout=self.settings.prm.timeout_s,
                                             transport=transport)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _ask_prm(self, prompt: str, steps: list[str]) -> list[float]:
        if self._client is None or self.settings.prm is None:
            raise RuntimeError("the PRM client is not open (use the bridge as a context)")
        try:
            response = await self._client.post(
                self.settings.prm.url, json={"prompt": prompt, "steps": steps})
            response.raise_for_status()
            body: Any = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ScoringError("prm_error", f"process reward model: {exc!r}") from exc
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list) or len(scores) != len(steps):
            raise ScoringError("prm_error", f"process reward model answered {body!r} "
                              f"for {len(steps)} steps")
        return [float(score) for score in scores]
