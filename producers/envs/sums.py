"""``sums``: single-digit addition as a reasoning-shaped task, the smallest one a tiny model learns.

The data is the shipped ``producers/data/sums.jsonl`` (``producers.data.make_sums``): the
100 ordered pairs ``a + b`` with a, b in 0..9, 80 for training and 20 held out (fixed by
a seed). Prompts are chat messages, ``What is 3 + 4?``; the target answer format is
``<think>3 + 4</think> \\boxed{7}``. Records are MATH-format, so the group metadata is the
dataset env's: ``answer`` = ``\\boxed{7}`` (what the accuracy reward reads), ``gold`` =
``7``, ``solution``, ``index``. The shipped reward is ``examples/rewards/sums.yaml``.

Answers range over 0..18 (19 values): an answer drawn uniformly at random is right with
probability ``CHANCE`` = 1/19.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from rollq.producers.envs.dataset import MATH, DatasetEnv, PromptStyle, load_records
from rollq.schemas import ConfigError

Split = Literal["train", "heldout", "all"]

CHANCE = 1 / 19
"""Accuracy of a uniformly random answer in 0..18."""


def sums_path() -> str:
    """Path of the shipped ``sums.jsonl``."""
    return str(resources.files("rollq.producers.data").joinpath("sums.jsonl"))


def split_records(task: str, source: str | Path, split: Split) -> list[dict[str, Any]]:
    """The records of ``source`` whose ``split`` field is ``split`` (``all``: every one), in
    file order; a bad ``split`` is a ``ConfigError`` naming ``task``. The shipped tasks'
    files (``sums``, ``tools``) mark each record ``train`` or ``heldout``."""
    if split not in ("train", "heldout", "all"):
        raise ConfigError(f"{task}: split must be train, heldout or all, not {split!r}")
    return [r for r in load_records(source) if split == "all" or r.get("split") == split]


def sums_records(split: Split = "train", source: str | Path | None = None) -> list[dict[str, Any]]:
    """The records of ``split`` (``train``: 80, ``heldout``: 20, ``all``: 100), file order."""
    return split_records("sums", source or sums_path(), split)


def sums_env(*, split: Split = "train", source: str | Path | None = None, name: str = "sums",
             style: PromptStyle | None = None) -> DatasetEnv:
    """The ``sums`` env over ``split`` (the worker and feeder use ``train``)."""
    return DatasetEnv(name, sums_records(split, source), MATH, style or PromptStyle())
