"""The start-up heap freeze (``schemas.heap``): off unless the ``rollq`` program turns it
on, and what start-up left as garbage is collected, not frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from rollq.ops import cli
from rollq.schemas import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def restored() -> Iterator[None]:
    yield
    heap.freeze_after_startup(False)
    gc.unfreeze()


def test_startup_done_does_nothing_unless_turned_on(restored: None) -> None:
    before = gc.get_freeze_count()
    assert heap.startup_done() == 0
    assert gc.get_freeze_count() == before


def test_startup_done_collects_then_freezes(restored: None) -> None:
    garbage = _Node()
    dead = weakref.ref(garbage)
    kept = _Node()
    del garbage
    heap.freeze_after_startup()
    frozen = heap.startup_done()
    assert frozen == gc.get_freeze_count() > 0
    assert dead() is None  # collected before the freeze, never stranded in it
    assert gc.is_tracked(kept)


def test_freeze_heap_freezes_whatever_the_switch(restored: None) -> None:
    assert heap.freeze_heap() == gc.get_freeze_count() > 0


def test_the_rollq_program_turns_it_on(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(heap._enabled) or 0)
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 0
    assert seen == [True]
