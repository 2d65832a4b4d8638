"""Table tests of the pure rules: staleness and batch sizing."""

from __future__ import annotations

import pytest

from rollq.consumers.trainer import BatchSize, is_stale


@pytest.mark.parametrize(
    ("group_version", "current", "max_staleness", "stale"),
    [
        (5, 5, 0, False),
        (4, 5, 0, True),
        (4, 5, 1, False),
        (3, 5, 1, True),
        (3, 5, 2, False),
        (0, 0, 0, False),
        (7, 5, 0, False),  # newer than the trainer (after a resume): never stale
        (0, 100, None, False),  # check disabled
        (97, 100, 3, False),
        (96, 100, 3, True),
    ],
)
def test_is_stale(group_version: int, current: int, max_staleness: int | None,
                  stale: bool) -> None:
    assert is_stale(group_version, current, max_staleness) is stale


def test_is_stale_rejects_negative_staleness() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        is_stale(1, 1, -1)


# Each queued group is (sequences, tokens).
G = (4, 100)


@pytest.mark.parametrize(
    ("size", "queued", "expected"),
    [
        (BatchSize(groups=2), [], (0, False)),
        (BatchSize(groups=2), [G], (1, False)),
        (BatchSize(groups=2), [G, G, G], (2, True)),
        (BatchSize(sequences=8), [G, G, G], (2, True)),  # exactly met
        (BatchSize(sequences=10), [G, G, G], (2, True)),  # third would overflow
        (BatchSize(sequences=10), [G, G], (2, False)),  # not full: a smaller group may fit
        (BatchSize(sequences=2), [G, G], (1, True)),  # first group always taken
        (BatchSize(max_tokens=250), [G, G, G], (2, True)),
        (BatchSize(max_tokens=250), [G, G], (2, False)),
        (BatchSize(max_tokens=50), [G], (1, True)),
        (BatchSize(max_tokens=200), [(2, 50), (2, 150), (2, 10)], (2, True)),
        (BatchSize(groups=5, max_tokens=150), [G, G], (1, True)),
    ],
)
def test_batch_size_fit(size: BatchSize, queued: list[tuple[int, int]],
                        expected: tuple[int, bool]) -> None:
    assert size.fit(queued) == expected


def test_batch_size_defaults_and_validation() -> None:
    assert BatchSize.of(None, None, None, 8) == BatchSize(groups=8)
    assert BatchSize.of(None, None, 512, 8) == BatchSize(max_tokens=512)
    with pytest.raises(ValueError, match="groups"):
        BatchSize.of(0, None, None, 8)
