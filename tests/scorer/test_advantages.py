"""Advantages on hand-computed groups."""

from __future__ import annotations

import numpy as np
import pytest

from rollq.consumers.scorer import (
    AdvantageMethod,
    broadcast_advantages,
    compute_advantages,
    compute_process_advantages,
    is_zero_variance,
)

HALF_SQRT3 = 0.8660254  # 0.5 / sqrt(1/3)


@pytest.mark.parametrize(("method", "ddof", "rewards", "expected"), [
    ("grpo", 0, [1, 0, 0, 1], [1, -1, -1, 1]),                 # std 0.5
    ("grpo", 1, [1, 0, 0, 1], [HALF_SQRT3, -HALF_SQRT3, -HALF_SQRT3, HALF_SQRT3]),
    ("grpo", 0, [3, 1], [1, -1]),
    ("grpo", 1, [5], [0]),                                     # n ≤ ddof: std 0
    ("dr_grpo", 0, [1, 0, 0, 1], [0.5, -0.5, -0.5, 0.5]),
    ("dr_grpo", 0, [2.0, 0.5], [0.75, -0.75]),
    ("rloo", 0, [1, 0, 0, 0], [1, -1 / 3, -1 / 3, -1 / 3]),
    ("rloo", 0, [4, 2], [2, -2]),
    ("rloo", 0, [7], [0]),                                     # a group of one
])
def test_compute_advantages(method: AdvantageMethod, ddof: int, rewards: list[float],
                            expected: list[float]) -> None:
    result = compute_advantages(np.array(rewards, dtype=np.float64), method, eps=1e-9,
                                ddof=ddof)
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-7)


def test_grpo_eps_is_added_to_std() -> None:
    result = compute_advantages([1.0, 0.0], "grpo", eps=0.5, ddof=0)
    np.testing.assert_allclose(result, [0.5, -0.5])  # 0.5 / (0.5 + 0.5)


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="ppo"):
        compute_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]


def test_zero_variance_is_detected_on_variance_not_mean() -> None:
    shaped = [-0.3, -0.3, -0.3, -0.3]
    # A mean filter (drop groups whose mean is 0 or 1) lets this group through...
    assert np.mean(shaped) not in (0.0, 1.0)
    # ...though it carries no signal; the variance filter catches it.
    assert is_zero_variance(shaped)
    assert is_zero_variance([0.25 + 1e-9, 0.25, 0.25], tolerance=1e-12)
    assert not is_zero_variance([1.0, 1.0, 0.999])
    assert is_zero_variance([1.0, 1.0, 0.999], tolerance=1e-3)
    assert is_zero_variance([0.7])


def test_broadcast_advantages() -> None:
    result = broadcast_advantages(np.array([1.5, -1.5], dtype=np.float32), [2, 3])
    assert [r.tolist() for r in result] == [[1.5, 1.5], [-1.5, -1.5, -1.5]]
    assert all(r.dtype == np.float32 for r in result)
    assert all(r.strides == (0,) and not r.flags.writeable for r in result)  # no per-token copy


def test_process_advantages_return_to_go() -> None:
    # Group step scores {1, 0, 1}: mean 2/3, std sqrt(2/9); normalised 1 -> 1/sqrt(2),
    # 0 -> -sqrt(2).
    high, low = 1 / np.sqrt(2), -np.sqrt(2)
    result = compute_process_advantages(
        step_ends=[np.array([1, 3]), np.array([2])],
        step_scores=[np.array([1.0, 0.0], np.float32), np.array([1.0], np.float32)],
        lengths=[5, 4], eps=0.0)
    np.testing.assert_allclose(result[0], [high + low, high + low, low, low, 0], rtol=1e-6)
    np.testing.assert_allclose(result[1], [high, high, high, 0], rtol=1e-6)
    assert all(r.dtype == np.float32 for r in result)


def test_process_advantages_without_steps_are_zero() -> None:
    result = compute_process_advantages([np.zeros(0, np.int64)], [np.zeros(0, np.float32)],
                                        [3])
    assert result[0].tolist() == [0.0, 0.0, 0.0]
