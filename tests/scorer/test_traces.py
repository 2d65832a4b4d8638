"""Trace extraction: one row per edge case of the documented policy."""

from __future__ import annotations

import pytest

from rollq.consumers.scorer import Trace, extract_reasoning

CASES = [
    # (id, text, server reasoning, reasoning, answer, source, closed, preamble)
    ("no_tags", "just 42", None, "", "just 42", "none", False, ""),
    ("one_block", "<think> a </think> 42", None, "a", "42", "tags", True, ""),
    ("unclosed", "<think>a and b", None, "a and b", "", "tags", False, ""),
    ("close_without_open", "a\n</think>\n42", None, "a", "42", "tags", True, ""),
    ("several_blocks", "<think>a</think>x<think>b</think> 42", None, "a\nb", "42", "tags",
     True, ""),
    ("text_before_open", "Sure. <think>a</think> 42", None, "a", "42", "tags", True, "Sure."),
    ("empty_answer", "<think>a</think>  ", None, "a", "", "tags", True, ""),
    ("closed_then_unclosed", "<think>a</think>x<think>b", None, "a\nb", "", "tags", False, ""),
    ("nested_open_is_text", "<think>a<think>b</think>c", None, "a<think>b", "c", "tags", True,
     ""),
    ("two_closes_without_open", "a</think>b</think>c", None, "a\nb", "c", "tags", True, ""),
    ("server_field_wins", "<think>ignored</think> 42", "server says", "server says",
     "<think>ignored</think> 42", "server_field", True, ""),
    ("empty_server_field_falls_back", "<think>a</think>42", "", "a", "42", "tags", True, ""),
    ("empty_text", "", None, "", "", "none", False, ""),
]


@pytest.mark.parametrize(
    ("text", "server", "reasoning", "answer", "source", "closed", "preamble"),
    [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_extract_reasoning_policy(
    text: str, server: str | None, reasoning: str, answer: str, source: str, closed: bool,
    preamble: str,
) -> None:
    trace = extract_reasoning(text, reasoning=server)
    assert (trace.reasoning, trace.answer, trace.source, trace.closed, trace.preamble) == (
        reasoning, answer, source, closed, preamble)


def test_custom_tags_and_block_spans() -> None:
    text = "pre [r]one[/r] mid [r]two[/r] end"
    trace = extract_reasoning(text, open_tag="[r]", close_tag="[/r]")
    assert trace == Trace(reasoning="one\ntwo", answer="end", source="tags", closed=True,
                          blocks=((7, 10), (22, 25)), preamble="pre")
    assert [text[start:end] for start, end in trace.blocks] == ["one", "two"]
