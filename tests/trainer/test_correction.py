"""The off-policy correction's math and its refusals (issue 44), table by table: each method's
weights and dropped fraction on known ratios, which sampler logprobs can be compared with
the trainer's, and the staleness histogram."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollq.consumers.trainer.correction import (
    IsCorrection,
    check_logprobs,
    importance_weights,
    staleness_histogram,
    unusable,
)
from rollq.schemas import ConfigError
from rollq.schemas.models import SamplingRecord

torch = pytest.importorskip("torch")

# one sequence per row; ratios exp(trainer - sampler): row 0 [1, 3, 0.25, pad], row 1 [1.005] * 3
RATIOS = [[1.0, 3.0, 0.25, 1.0], [1.005, 1.005, 1.005, 1.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 0]]


def weights_of(correction: IsCorrection) -> tuple[list[list[float]], dict[str, float]]:
    sampler = torch.full((2, 4), -2.0)
    trainer = sampler + torch.log(torch.tensor(RATIOS))
    weights, stats = importance_weights(trainer.requires_grad_(), sampler,
                                        torch.tensor(MASK, dtype=torch.float32), correction)
    assert not weights.requires_grad
    masked = (weights * torch.tensor(MASK)).tolist()
    return [[round(w, 4) for w in row] for row in masked], stats


@pytest.mark.parametrize(("correction", "weights", "dropped"), [
    (IsCorrection("none"), [[1, 1, 1, 0], [1, 1, 1, 0]], 0),
    (IsCorrection("tis", tis_cap=2.0), [[1, 2, 0.25, 0], [1.005] * 3 + [0]], 1 / 6),
    (IsCorrection("mis", token_mask=(0.5, 2.0)), [[1, 0, 0, 0], [1.005] * 3 + [0]], 2 / 6),
    # row 0's geometric mean is (1 · 3 · 0.25)^(1/3) = 0.909: out of [0.99, 1.01]
    (IsCorrection("geo", geo_mask=(0.99, 1.01)), [[0, 0, 0, 0], [1, 1, 1, 0]], 3 / 6),
    (IsCorrection("geo", geo_mask=(0.9, 1.1)), [[1, 1, 1, 0], [1, 1, 1, 0]], 0),
])
def test_each_method_bounds_the_ratio_its_own_way(correction: IsCorrection,
                                                  weights: list[list[float]],
                                                  dropped: float) -> None:
    got, stats = weights_of(correction)
    assert got == weights
    assert stats["is_filter_drop_frac"] == pytest.approx(dropped)
    assert stats["is_ratio_mean"] == pytest.approx((1 + 3 + 0.25 + 3 * 1.005) / 6, rel=1e-5)


@pytest.mark.parametrize("correction", [
    IsCorrection("tis"), IsCorrection("mis"), IsCorrection("geo"),
    IsCorrection("geo", geo_mask=(0.9, 1.1))])
def test_the_packed_layout_weighs_as_the_padded_one(correction: IsCorrection) -> None:
    """examples/torchrun_trainer.py's micro-batches are packed: several sequences share a
    row, ``sequences`` says whose each token is; ``geo`` must still average each sequence
    over its own tokens (the row as one sequence would keep or drop them all together)."""
    padded, padded_stats = weights_of(correction)
    lengths = [3, 3]  # RATIOS' rows without their padding, back to back
    ratios = [r for row, n in zip(RATIOS, lengths, strict=True) for r in row[:n]]
    sampler = torch.full((6,), -2.0)
    weights, stats = importance_weights(sampler + torch.log(torch.tensor(ratios)), sampler,
                                        torch.ones(6), correction,
                                        sequences=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert [round(w, 4) for w in weights.tolist()] == [
        w for row, n in zip(padded, lengths, strict=True) for w in row[:n]]
    assert stats == pytest.approx(padded_stats)


def test_a_huge_log_ratio_gives_a_finite_weight() -> None:
    trainer, sampler = torch.tensor([[0.0]]), torch.tensor([[-500.0]])
    weights, stats = importance_weights(trainer, sampler, torch.ones(1, 1), IsCorrection("tis"))
    assert weights.item() == 2.0 and math.isfinite(stats["is_ratio_mean"])


RAW = SamplingRecord(temperature=0.7, top_p=0.9, logprobs_mode="raw_logprobs")
NEUTRAL = SamplingRecord(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                         logprobs_mode="processed_logprobs")


@pytest.mark.parametrize(("record", "reason"), [
    (RAW, None),  # raw logprobs are the model's, whatever the sampling
    (NEUTRAL, None),  # nothing processed them
    (NEUTRAL.model_copy(update={"top_p": 0.9}), "top_p=0.9"),  # TRL #6945: the kept mass
    (NEUTRAL.model_copy(update={"top_k": None}), "top_k=None"),  # the server's default
    (NEUTRAL.model_copy(update={"temperature": 0.6}), "temperature=0.6"),
    (SamplingRecord(logprobs_mode="raw_logits"), "raw_logits, not logprobs"),
    (SamplingRecord(temperature=1.0), "logprobs mode is not known"),
    (None, "not recorded"),
])
def test_which_sampler_logprobs_the_trainer_can_compare(record: SamplingRecord | None,
                                                       reason: str | None) -> None:
    why = unusable(record)
    assert why is None if reason is None else reason in (why or "")


def test_a_batch_the_correction_cannot_use_is_refused_by_name() -> None:
    batch = [RAW, NEUTRAL.model_copy(update={"top_p": 0.5}), None]
    check_logprobs(batch, "none")  # no correction: nothing to refuse
    with pytest.raises(ConfigError, match=r"--is-correction mis cannot use this batch: "
                                          r"sequence 1 \(and 1 more of 3\): processed_logprobs"):
        check_logprobs(batch, "mis")


@pytest.mark.parametrize("bad", [
    {"method": "ratio"}, {"tis_cap": 0.0}, {"token_mask": (2.0, 0.5)}, {"geo_mask": (-1, 1)},
])
def test_bad_thresholds_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        IsCorrection(**bad)  # type: ignore[arg-type]


def test_staleness_histogram_counts_trainable_tokens_by_versions_behind() -> None:
    versions = np.array([[-1, 3, 3, 5], [-1, 4, 4, -1]], np.int32)
    mask = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], np.float32)
    assert staleness_histogram(versions, mask, 5) == {"0": 1, "1": 2, "2": 2}
    assert staleness_histogram(versions, np.zeros_like(mask), 5) == {}
