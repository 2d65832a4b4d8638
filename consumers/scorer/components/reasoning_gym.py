"""A reasoning-gym task's own scorer as a reward component: `reasoning_gym`.

The `reasoning_gym:TASK[+TASK...]` env kind puts the item it prompted with into the group's
metadata (`reasoning_gym`: the dataset's `create_dataset` name and config, the item's
index, and the item in tagged JSON, `schemas.tagged`). This component rebuilds that
dataset (once per scoring process and configuration, never per sample), extracts the
completion's answer and returns the task's own `score_answer(answer, entry)`: a value in
[0, 1], partial credit kept as the task gives it (a composite dispatches to the item's
task). Needs the `reasoning-gym` extra where the scorer runs.

Failures follow the taxonomy: a task scorer that raises on an odd answer (some do, on
answers they cannot parse) is a failed call — retried, then the entry's `on_error`
(`reward_error`, or skipped and flagged) — never a score of 0; metadata naming a dataset
or configuration reasoning-gym refuses is `reward_bad_data`.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rollq.consumers.scorer.components.base import ComponentSettings, Placement, RewardComponent
from rollq.consumers.scorer.errors import ScoringError
from rollq.consumers.scorer.sample import Sample
from rollq.schemas.tagged import decode_tagged

Extraction = Literal["answer_tag", "boxed", "none"]
"""How the answer is taken from the completion's answer region (`ReasoningGymSettings`)."""


class ReasoningGymSettings(ComponentSettings):
    """Settings of `reasoning_gym`.

    - `field`: the group metadata field the env kind writes (default `reasoning_gym`).
    - `answer_region`: `answer` (default) reads the text after the reasoning trace (the
      trace's answer: the whole completion when it has no tags, nothing when the last
      block is unclosed); `whole` reads the whole completion.
    - `extract`: `answer_tag` (default) takes the last `<answer>...</answer>` in the
      region, stripped (reasoning-gym's own `extract_answer`, what its system prompts ask
      for); `boxed` the content of the last `\\boxed{}`; `none` the region stripped. Where
      nothing is found the task scores `None` itself (0.0 in every task checked).
    """

    field: str = "reasoning_gym"
    answer_region: Literal["answer", "whole"] = "answer"
    extract: Extraction = "answer_tag"


class ReasoningGym(RewardComponent[ReasoningGymSettings]):
    """The task's own `score_answer` of the extracted answer (module docstring); runs in
    the scorer's process pool (some tasks' scorers simulate or call sympy)."""

    settings_model = ReasoningGymSettings
    preload_modules = ("reasoning_gym",)

    @property
    def placement(self) -> Placement:
        return "process"

    def required_fields(self) -> tuple[str, ...]:
        return (self.settings.field,)

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        item = sample.lookup(self.settings.field)
        if not isinstance(item, Mapping) or not {"dataset", "config", "entry"} <= set(item):
            raise ScoringError("bad_tests", f"metadata field {self.settings.field!r} is not a "
                               "reasoning-gym item ({dataset, config, index, entry})")
        dataset = _dataset(str(item["dataset"]), item["config"])
        text = sample.region_text("answer" if self.settings.answer_region == "answer"
                                  else "anywhere")
        value = dataset.score_answer(extract_answer(text, self.settings.extract),
                                     decode_tagged(item["entry"]))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise ScoringError("error", f"{item['dataset']}'s score_answer returned {value!r}, "
                               "not a finite number")
        return float(value)


def extract_answer(text: str, how: Extraction) -> str | None:
    """The answer in ``text``: the last ``<answer>`` block (reasoning-gym's own
    ``extract_answer``), the last ``\\boxed{}``'s content, or the text stripped; None
    when there is none."""
    if how == "none":
        return text.strip()
    if how == "boxed":
        start = text.rfind("\\boxed{")
        if start == -1:
            return None
        depth, begin = 1, start + len("\\boxed{")
        for position in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                return text[begin:position].strip()
        return None
    from reasoning_gym.utils import extract_answer as tagged_answer

    found: str | None = tagged_answer(text)
    return found


_DATASETS_KEPT = 32
"""Datasets one process keeps (least recently used dropped first): a run names one
configuration, a rescore of several runs a few."""
_datasets: OrderedDict[str, Any] = OrderedDict()


def _dataset(name: str, config: Any) -> Any:
    """``create_dataset(name, **config)``, built once per process and configuration (a
    composite's ``datasets`` are rebuilt as reasoning-gym's ``DatasetSpec``s)."""
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    key = json.dumps([name, config], sort_keys=True)
    found = _datasets.get(key)
    if found is not None:
        _datasets.move_to_end(key)
        return found
    if not isinstance(config, Mapping):
        raise ScoringError("bad_tests", f"reasoning-gym config for {name!r} is not an object")
    kwargs: dict[str, Any] = dict(config)
    try:
        if "datasets" in kwargs:
            kwargs["datasets"] = [DatasetSpec(**spec) for spec in kwargs["datasets"]]
        dataset = reasoning_gym.create_dataset(name, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as exc:
        raise ScoringError("bad_tests", f"reasoning-gym refused dataset {name!r} with "
                           f"{config}: {type(exc).__name__}: {exc}") from None
    _datasets[key] = dataset
    if len(_datasets) > _DATASETS_KEPT:
        _datasets.popitem(last=False)
    return dataset
