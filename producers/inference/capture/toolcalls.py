"""Tool calls in generated text, for replies rollq builds itself (token-in chat calls).

A chat call sent as token ids goes to ``/v1/completions``, where the server's tool parser
does not run; its reply is turned into a chat message here with the Hermes format (Qwen2,
Qwen2.5, Hermes, most chat templates with tools): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, content being the text before the first block. Same rules as
vLLM's ``hermes`` parser: unparseable JSON leaves the whole text as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
START = "<tool_call>"


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of generated text; tool calls in OpenAI's shape."""
    if START not in text:
        return text, []
    try:
        calls = [json.loads(first or rest) for first, rest in _TOOL_CALL.findall(text)]
        tool_calls = [{
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": str(call["name"]),
                         "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)},
        } for call in calls]
    except (ValueError, KeyError, TypeError):
        return text, []
    content = text[:text.find(START)]
    return content or None, tool_calls
