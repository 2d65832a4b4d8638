"""The `think` format preset tested by string search answers exactly as its regex does."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollq.consumers.scorer.components import Format, FormatSettings
from rollq.consumers.scorer.components.format import FORMAT_PRESETS, matches_think_preset
from rollq.consumers.scorer.traces import find_tag

THINK = re.compile(FORMAT_PRESETS["think"], re.DOTALL | re.MULTILINE)

# texts built from the pieces the regex cares about, so that near misses are common
pieces = st.sampled_from(["<think>", "</think>", "<think", "think>", "</", "<", ">", "\n",
                          "a", " ", "é", "<THINK>"])
texts = st.lists(pieces, max_size=12).map("".join)


@settings(max_examples=3000, deadline=None)
@given(texts)
def test_think_search_agrees_with_the_regex(text: str) -> None:
    assert matches_think_preset(text) == bool(THINK.match(text))


@pytest.mark.parametrize("text", ["<think>a</think>b", "<think></think>", "<think>\n</think>\n",
                                  "<think>a<think>b</think>", "x<think>a</think>", "<think>",
                                  "<think>a</think><think>", "</think><think>a</think>", ""])
def test_think_search_on_edge_cases(text: str) -> None:
    assert matches_think_preset(text) == bool(THINK.match(text))


def test_the_search_serves_only_flags_under_which_it_is_exact() -> None:
    assert Format(FormatSettings(preset="think")).matcher is matches_think_preset
    assert Format(FormatSettings(preset="think", flags=("DOTALL",))).matcher \
        is matches_think_preset
    for flags in [("MULTILINE",), ("DOTALL", "IGNORECASE"), ()]:
        component = Format(FormatSettings(preset="think", flags=flags))
        assert component.matcher is not matches_think_preset
    # without DOTALL the regex stops at a newline: the search would differ
    sample = "<think>a\n</think>"
    assert Format(FormatSettings(preset="think", flags=("MULTILINE",))).matcher(sample) is None


@settings(max_examples=3000, deadline=None)
@given(st.lists(pieces, max_size=40).map("".join), st.sampled_from(["<think>", "</think>", "<",
                                                                     "think", ""]),
       st.integers(min_value=-3, max_value=60))
def test_find_tag_is_str_find(text: str, tag: str, start: int) -> None:
    assert find_tag(text, tag, start) == text.find(tag, start)


def test_find_tag_past_many_false_starts() -> None:
    text = "<a " * 50 + "<think>x"
    assert find_tag(text, "<think>") == text.find("<think>") == 150
