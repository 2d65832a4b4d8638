"""Off-policy correction: importance weights between the trainer's policy and the sampler's.

An async bus trains on tokens an older policy sampled (``max_staleness`` versions back), on
another engine (vLLM's kernels, not the trainer's). The per-token importance ratio
``r = π_trainer(token) / π_sampler(token) = exp(logprob - sampler_logprob)`` corrects for
both, but a ratio far from 1 has a huge variance; each method bounds it its own way:

- ``tis``: token-level truncated IS, ``w = min(r, cap)`` (Yao et al.'s TIS; TRL's
  ``token_truncate``). Tokens above ``cap`` count as dropped: their weight is cut.
- ``mis``: masked IS, ``w = r`` where ``low ≤ r ≤ high``, else 0 (IcePop; TRL's
  ``token_mask``): a token the two policies disagree on is left out.
- ``geo``: geometric sequence masking, a whole sequence is left out when the geometric
  mean of its trainable tokens' ratios, ``exp(mean(log r))``, is outside ``[low, high]``
  (SkyRL's ``sequence_mask_metric: geometric``; it stayed stable where plain TIS blew up,
  SkyRL #1665); kept sequences weigh 1.
- ``none``: no weight; the caller's loss uses the sampler's logprobs as its old policy.

The weights multiply a PPO loss whose ratio is taken against the trainer's own policy
before this step (the proximal policy, ``logprobs.detach()`` in a one-update step): the
behaviour policy's part of the ratio lives in ``w`` (AReaL's decoupled PPO).

The ratio is only meaningful when the sampler's logprobs are the same kind of number as
the trainer's: the model's log-softmax at temperature 1. vLLM's default ``raw_logprobs``
are; ``processed_logprobs`` are only when nothing processed them (temperature 1, top_p 1,
top_k and min_p off, each sent by the request: a value left to the server's default may
come from the model's ``generation_config.json``): with top_p < 1 an unchanged policy
reads the kept mass, not 1 (TRL #6945). ``check_logprobs`` refuses a batch whose
``SamplingRecord`` says otherwise, or says nothing. The weights are computed with torch,
imported here only, inside the function that needs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from rollq.schemas import ConfigError
from rollq.schemas.models import SamplingRecord

CorrectionMethod = Literal["none", "tis", "mis", "geo"]
CORRECTION_METHODS: tuple[CorrectionMethod, ...] = ("none", "tis", "mis", "geo")
MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±this before ``exp`` (a ratio of 5e8: no float32 overflow)."""


@dataclass(frozen=True)
class IsCorrection:
    """Which correction, with its thresholds (module docstring)."""

    method: CorrectionMethod = "none"
    tis_cap: float = 2.0
    """``tis``: the largest weight (SkyRL's default; 1.5–5 is the usual range)."""
    token_mask: tuple[float, float] = (0.5, 2.0)
    """``mis``: the ``[low, high]`` a token's ratio must lie in (IcePop's bounds)."""
    geo_mask: tuple[float, float] = (0.99, 1.01)
    """``geo``: the ``[low, high]`` a sequence's geometric-mean ratio must lie in (SkyRL's
    default; MoE models, whose routing differs between engines, may need wider)."""

    def __post_init__(self) -> None:
        if self.method not in CORRECTION_METHODS:
            raise ValueError(f"is correction must be one of {', '.join(CORRECTION_METHODS)}, "
                             f"got {self.method!r}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be above 0, got {self.tis_cap}")
        for name in ("token_mask", "geo_mask"):
            low, high = getattr(self, name)
            if not 0 <= low < high:
                raise ValueError(f"{name} must be [low, high] with 0 <= low < high, got "
                                 f"{[low, high]}")


def add_correction_arguments(parser: argparse.ArgumentParser) -> None:
    """``--is-correction`` and its thresholds, as the example trainers take them (read them
    back with ``correction_from``)."""
    parser.add_argument("--is-correction", choices=CORRECTION_METHODS, default="none",
                        help="off-policy correction: truncated IS, masked IS, geometric "
                             "sequence masking [none]")
    parser.add_argument("--is-tis-cap", type=float, default=2.0,
                        help="tis: the largest token weight [2.0]")
    parser.add_argument("--is-token-mask", type=float, nargs=2, default=(0.5, 2.0),
                        metavar=("LOW", "HIGH"), help="mis: token ratios kept [0.5 2.0]")
    parser.add_argument("--is-geo-mask", type=float, nargs=2, default=(0.99, 1.01),
                        metavar=("LOW", "HIGH"),
                        help="geo: sequence geometric-mean ratios kept [0.99 1.01]")


def correction_from(args: argparse.Namespace) -> IsCorrection:
    """The ``IsCorrection`` that ``add_correction_arguments``' flags name."""
    return IsCorrection(args.is_correction, args.is_tis_cap, tuple(args.is_token_mask),
                        tuple(args.is_geo_mask))


def unusable(record: SamplingRecord | None) -> str | None:
    """Why a sequence's sampler logprobs cannot be compared with the trainer's (module
    docstring), or None when they can."""
    if record is None:
        return ("its sampling was not recorded (an entry of schema version 1, or a producer "
                "that does not record it)")
    mode = record.logprobs_mode
    if mode is None:
        return ("the server's logprobs mode is not known: set the workers' logprobs_mode "
                "(ROLLQ_LOGPROBS_MODE) or run vLLM with VLLM_SERVER_DEV_MODE=1")
    if mode == "raw_logprobs":
        return None
    if mode != "processed_logprobs":
        return f"the server returns {mode}, not logprobs"
    processed = [f"{name}={value!r}" for name, value, neutral in (
        ("temperature", record.temperature, (1.0,)), ("top_p", record.top_p, (1.0,)),
        ("top_k", record.top_k, (-1, 0)), ("min_p", record.min_p, (0.0,)))
        if value not in neutral]
    if processed:
        return (f"processed_logprobs with {', '.join(processed)} (None: left to the server's "
                "default) are not the model's probabilities; serve with --logprobs-mode "
                "raw_logprobs, or sample with temperature 1, top_p 1, top_k -1, min_p 0")
    return None


def check_logprobs(sampling: Sequence[SamplingRecord | None], method: CorrectionMethod) -> None:
    """``ConfigError`` naming the first sequence (and how many) whose logprobs cannot support
    ``method`` (``unusable``); ``none`` accepts every batch."""
    if method == "none":
        return
    reasons = [(index, why) for index, record in enumerate(sampling)
               if (why := unusable(record)) is not None]
    if reasons:
        index, why = reasons[0]
        raise ConfigError(f"--is-correction {method} cannot use this batch: sequence {index} "
                          f"(and {len(reasons) - 1} more of {len(sampling)}): {why}")


def importance_weights(logprobs: Any, sampler_logprobs: Any, mask: Any,
                       correction: IsCorrection,
                       sequences: Any = None) -> tuple[Any, dict[str, float]]:
    """The weight of each token (a tensor shaped like ``logprobs``, no gradient) and the
    step's statistics: ``is_ratio_mean`` (the mean ratio over trainable tokens, before any
    bound) and ``is_filter_drop_frac`` (the fraction of trainable tokens whose weight was
    cut or zeroed). ``mask`` is 1 on trainable tokens; ``logprobs`` are the trainer's
    (detached here). Rows are sequences (the padded layout, ``[B, T]``), or, with
    ``sequences`` (an integer tensor shaped like ``logprobs``: each token's sequence, 0..B-1),
    several sequences share a row (the packed layout, ``[N]``): ``geo`` takes each
    sequence's mean over its own tokens either way."""
    import torch

    trainable = mask > 0
    tokens = trainable.sum().clamp(min=1)
    log_ratio = torch.where(trainable, logprobs.detach() - sampler_logprobs,
                            torch.zeros_like(sampler_logprobs))
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if correction.method == "tis":
        weights = ratio.clamp(max=correction.tis_cap)
        dropped = trainable & (ratio > correction.tis_cap)
    elif correction.method == "mis":
        low, high = correction.token_mask
        kept = (ratio >= low) & (ratio <= high)
        weights = torch.where(kept, ratio, torch.zeros_like(ratio))
        dropped = trainable & ~kept
    elif correction.method == "geo":
        low, high = correction.geo_mask
        if sequences is None:  # a row a sequence
            mean_log = log_ratio.sum(dim=-1) / trainable.sum(dim=-1).clamp(min=1)
        else:
            count = int(sequences.max()) + 1 if sequences.numel() else 0
            sums = log_ratio.new_zeros(count).index_add_(0, sequences.flatten(),
                                                         log_ratio.flatten())
            tokens_of = log_ratio.new_zeros(count).index_add_(
                0, sequences.flatten(), trainable.flatten().to(log_ratio.dtype))
            mean_log = sums / tokens_of.clamp(min=1)
        geometric = torch.exp(mean_log.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        in_bounds = (geometric >= low) & (geometric <= high)
        kept = (in_bounds.unsqueeze(-1).expand_as(ratio) if sequences is None
                else in_bounds[sequences])
        weights = kept.to(ratio.dtype)
        dropped = trainable & ~kept
    else:
        weights, dropped = torch.ones_like(ratio), torch.zeros_like(trainable)
    stats = {"is_ratio_mean": float((ratio * trainable).sum() / tokens),
             "is_filter_drop_frac": float(dropped.sum() / tokens)}
    return weights, stats


def staleness_histogram(versions: np.ndarray[Any, Any], mask: np.ndarray[Any, Any],
                        current_version: int) -> dict[str, int]:
    """Trainable tokens by staleness (``current_version`` minus the version that sampled
    each), as ``{"0": n, "1": n, …}`` for a JSON metrics line; ``versions`` and ``mask``
    are aligned arrays of the batch (``targets()``)."""
    stale = current_version - versions[mask > 0].astype(np.int64)
    counts = np.bincount(np.clip(stale, 0, None)) if stale.size else np.zeros(0, np.int64)
    return {str(age): int(count) for age, count in enumerate(counts.tolist()) if count}
