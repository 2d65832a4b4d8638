"""Sample builders shared by the scorer tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rollq.consumers.scorer import Sample, extract_reasoning


def make_sample(
    text: str,
    *,
    tokens: int | None = None,
    ids: list[int] | None = None,
    reasoning: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    completion_metadata: Mapping[str, Any] | None = None,
    prompt: str = "",
) -> Sample:
    """A sample of `text`; `tokens` fake ids (default: one per char) unless `ids` given."""
    if ids is None:
        ids = list(range(len(text) if tokens is None else tokens))
    return Sample(
        text=text,
        completion_ids=np.asarray(ids, dtype=np.int32),
        trace=extract_reasoning(text, reasoning=reasoning),
        metadata=dict(metadata or {}),
        completion_metadata=dict(completion_metadata or {}),
        prompt=prompt,
    )
