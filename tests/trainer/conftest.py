"""Fixtures shared by the trainer SDK's tests."""

from __future__ import annotations

from typing import Any

import pytest

from rollq.consumers.trainer import layout
from rollq.schemas import ScoredGroup


@pytest.fixture
def layout_breaks_on(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Group ids whose layout raises (a group that decodes but cannot be laid out), as the
    reviewer's OverflowError did."""
    breaking: set[str] = set()
    write_tokens = layout._write_tokens

    def failing(groups: list[ScoredGroup], *args: Any, **kwargs: Any) -> None:
        if any(g.group_id in breaking for g in groups):
            raise OverflowError("Python integer 2147483648 out of bounds for int32")
        write_tokens(groups, *args, **kwargs)

    monkeypatch.setattr(layout, "_write_tokens", failing)
    return breaking
