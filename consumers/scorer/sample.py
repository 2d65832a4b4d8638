"""The unit a reward component scores: one completion, with its trace and its group's data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from rollq.consumers.scorer.traces import Trace

Region = Literal["anywhere", "reasoning", "answer"]
"""Which part of a completion a component reads: all of it, the reasoning, or the answer."""

LengthUnit = Literal["chars", "tokens"]
"""`chars`: `len(text)` (plus the server-split reasoning); `tokens`: `len(completion_ids)`."""

# eq=False: numpy arrays have no boolean equality; samples compare by identity.
@dataclass(frozen=True, eq=False)
class Sample:
    """One completion of a group, as the reward components see it.

    - `text`: the decoded completion (the content only, when the server split the
      reasoning out into its own field).
    - `completion_ids`: the completion's token ids (int32); token lengths are
      `len(completion_ids)`, never a re-tokenisation.
    - `trace`: the reasoning/answer split (`extract_reasoning`).
    - `finish_reason`: the server's finish reason (`"stop"`, `"length"`, ...).
    - `metadata`: the env's per-group metadata, e.g. `{"answer": "#### 42"}`. Keep
      it (and `completion_metadata`) picklable: pool components receive samples by
      pickle; the bridge turns other mappings into plain dicts at the pool boundary.
    - `prompt`: the prompt text, for components that need it (a process reward model).
    - `completion_metadata`: the env's per-completion metadata (e.g. step labels or
      spans); looked up before `metadata` by components that accept either.
    - `token_offsets`: optional char offset at which each token starts, in completion
      coordinates (see `full_text`); maps char spans to tokens exactly when given.
    - `correct`: set by the bridge from the correctness component before the components
      that need it run (True when its value is positive; None when unknown).
    """

    text: str
    completion_ids: NDArray[np.int32]
    trace: Trace
    finish_reason: str = "stop"
    metadata: Mapping[str, Any] = field(default_factory=dict)
    prompt: str = ""
    completion_metadata: Mapping[str, Any] = field(default_factory=dict)
    token_offsets: NDArray[np.int64] | None = None
    correct: bool | None = None

    def lookup(self, name: str) -> Any:
        """The value of metadata field `name`: per-completion first, then per-group.

        Raises KeyError when neither has it.
        """
        if name in self.completion_metadata:
            return self.completion_metadata[name]
        return self.metadata[name]

    def full_text(self) -> str:
        """The whole completion: the server-split reasoning (if any) followed by `text`."""
        if self.trace.source == "server_field":
            return self.trace.reasoning + self.text
        return self.text

    def region_text(self, region: Region) -> str:
        """The text of `region`: `anywhere` is `full_text()`, else the trace's part."""
        if region == "reasoning":
            return self.trace.reasoning
        if region == "answer":
            return self.trace.answer
        return self.full_text()

    def length(self, unit: LengthUnit) -> int:
        """The completion's length in `unit` (chars of `full_text()`, or tokens)."""
        if unit == "tokens":
            return len(self.completion_ids)
        return len(self.full_text())
