"""Group-relative advantages: GRPO, Dr.GRPO, RLOO, zero-variance detection, and per-token
advantages (sequence broadcast, or process-supervised return-to-go).

Defaults: `eps=1e-6` (verl; TRL uses 1e-4, AReaL 1e-5) and `ddof=0` (population std, as
verl; TRL uses the Bessel-corrected `ddof=1`). `eps` only guards the division: a group
whose rewards are all equal has zero advantages under GRPO whatever eps is, which is why
zero-variance groups get an explicit policy instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from rollq.schemas import broadcast

AdvantageMethod = Literal["grpo", "dr_grpo", "rloo"]


def compute_advantages(
    rewards: ArrayLike,
    method: AdvantageMethod = "grpo",
    eps: float = 1e-6,
    ddof: int = 0,
) -> NDArray[np.float32]:
    """Advantages of one group's sequence rewards (float32, same length).

    - `grpo`: `(r - mean) / (std + eps)`, std with `ddof` (0: population, 1: Bessel); a
      group too small for `ddof` (n ≤ ddof) has std 0.
    - `dr_grpo`: `r - mean` (Dr.GRPO: no std normalisation).
    - `rloo`: `r_i - mean(r_j, j ≠ i)`; a group of one → 0.
    """
    values: NDArray[np.float64] = np.asarray(rewards, dtype=np.float64)
    count = values.size
    result: NDArray[np.float64]
    if count == 0:
        return np.zeros(0, dtype=np.float32)
    mean = values.mean()
    if method == "grpo":
        std = float(values.std(ddof=ddof)) if count > ddof else 0.0
        result = (values - mean) / (std + eps)
    elif method == "dr_grpo":
        result = values - mean
    elif method == "rloo":
        if count == 1:
            return np.zeros(1, dtype=np.float32)
        result = values - (values.sum() - values) / (count - 1)
    else:
        raise ValueError(f"unknown advantage method {method!r}")
    return result.astype(np.float32)


def is_zero_variance(rewards: ArrayLike, tolerance: float = 1e-12) -> bool:
    """True when the rewards' (population) variance is ≤ `tolerance`: the group carries no
    learning signal. Checked on the variance, not the mean: under shaped rewards a group of
    equal rewards can have any mean (e.g. all -0.3), which a mean filter (all 0 / all 1)
    misses. A group of one is zero-variance."""
    values = np.asarray(rewards, dtype=np.float64)
    return values.size <= 1 or float(values.var()) <= tolerance


def broadcast_advantages(
    advantages: NDArray[np.float32], lengths: Sequence[int]
) -> list[NDArray[np.float32]]:
    """Each completion's sequence advantage repeated over its `lengths[i]` tokens.

    The arrays are read-only stride-0 views (`schemas.broadcast`): no per-token memory, the
    wire models take them without a copy, and the codec sees at a glance that they need not
    travel (the scored entry carries the sequence advantages only).
    """
    return broadcast(advantages, lengths)


def compute_process_advantages(
    step_ends: Sequence[NDArray[np.int64]],
    step_scores: Sequence[NDArray[np.float32]],
    lengths: Sequence[int],
    eps: float = 1e-6,
    ddof: int = 0,
) -> list[NDArray[np.float32]]:
    """Token advantages from step scores (DeepSeekMath §4.1.3, process supervision).

    All step scores of the group, R = {r_i,j}, are normalised together:
    `r̃_i,j = (r_i,j - mean(R)) / (std(R, ddof) + eps)`. The advantage of token t of
    completion i is the return-to-go of the normalised step rewards that end at or after
    it: `A_i,t = Σ_{j : end_i,j ≥ t} r̃_i,j`, where `end_i,j` is the token index of the
    last token of step j. Tokens after the last step get 0; a completion without steps
    gets zeros.
    """
    everything = np.concatenate([np.asarray(s, dtype=np.float64) for s in step_scores]
                                or [np.zeros(0)])
    if everything.size == 0:
        return [np.zeros(length, dtype=np.float32) for length in lengths]
    std = float(everything.std(ddof=ddof)) if everything.size > ddof else 0.0
    mean = everything.mean()
    result: list[NDArray[np.float32]] = []
    for ends, scores, length in zip(step_ends, step_scores, lengths, strict=True):
        per_end = np.zeros(length + 1, dtype=np.float64)
        normalised = (np.asarray(scores, dtype=np.float64) - mean) / (std + eps)
        np.add.at(per_end, np.asarray(ends, dtype=np.int64), normalised)
        # Reverse cumulative sum: token t collects every step ending at t or later.
        result.append(np.cumsum(per_end[::-1])[::-1][:length].astype(np.float32))
    return result
