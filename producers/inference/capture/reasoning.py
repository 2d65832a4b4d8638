"""Reasoning in generated text, for replies rollq builds itself (token-in chat calls).

A chat call sent as token ids goes to ``/v1/completions``, where the server's reasoning
parser does not run; when the server runs one (an earlier chat reply of the episode came
with ``reasoning``) and the request leaves thinking on, the text is split here as vLLM
0.32's ``qwen3`` (and ``deepseek_r1``) parser splits it: everything before ``</think>`` is
reasoning (a ``<think>`` in it dropped), the rest is content, both as generated (newlines
kept); without ``</think>`` a ``<tool_call>`` ends the reasoning, else all of it is
reasoning. ``chat_template_kwargs: {"enable_thinking": false}`` leaves the text as content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollq.producers.inference.capture.toolcalls import parse_hermes

THINK_START, THINK_END, TOOL_START = "<think>", "</think>", "<tool_call>"


def thinking_on(body: Mapping[str, Any]) -> bool:
    """Whether the request leaves the template's thinking on (Qwen3's ``enable_thinking``)."""
    options = body.get("chat_template_kwargs") or {}
    return not (isinstance(options, Mapping) and options.get("enable_thinking") is False)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of generated text (module docstring); None for empty."""
    reasoning, ended, content = text.partition(THINK_END)
    if not ended:
        at = text.find(TOOL_START)
        reasoning, content = (text[:at], text[at:]) if at >= 0 else (text, "")
    reasoning = reasoning.replace(THINK_START, "")
    content = content.replace(THINK_END, "")
    return reasoning or None, content or None


def assistant_message(text: str, *, reasoning: bool, tools: bool,
                      tool_parser: str | None) -> dict[str, Any]:
    """The chat message vLLM's parsers make of generated ``text``: its reasoning split off
    when ``reasoning`` (module docstring); with ``tools`` a ``tool_calls`` list, parsed
    when ``tool_parser`` is ``"hermes"`` (``capture.toolcalls``)."""
    thought, content = split_reasoning(text) if reasoning else (None, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thought is not None:
        message["reasoning"] = thought
    if tools:
        calls: list[dict[str, Any]] = []
        if tool_parser == "hermes" and content is not None:
            message["content"], calls = parse_hermes(content)
        message["tool_calls"] = calls
    return message
