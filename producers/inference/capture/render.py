"""``LocalTemplate``: the server's chat template applied in this process, checked against it.

A chat continuation is checked by rendering the conversation through the server's chat
template (``capture.session``): over ``/tokenize`` that is two HTTP requests to the vLLM
server per continuation call, on the call's critical path and on the server's CPU (its API
server parses, renders and tokenises; on a small CPU box that competes with generation).
Given the model's tokenizer and the template the server was started with, the capture layer
renders locally instead, as vLLM 0.32 does (``vllm.renderers.chat_utils``, "string" content
format): text content parts joined by newlines, ``None`` content as ``""``, an empty
``tool_calls`` dropped and tool-call ``arguments`` (JSON strings) parsed into objects,
``reasoning`` also given as ``reasoning_content``; then ``tokenizer.apply_chat_template``
and no special tokens added.

Exactness is checked, never assumed (``Upstream.render``): the first ``verify`` renders
(and at start, a probe conversation with tools, a tool call and a tool result) are also
asked of ``/tokenize`` and compared. On any difference the local template is dropped for
good: ``capture_local_render_disabled`` is logged with the first differing position, the
mismatch is counted (``Upstream.render_mismatches``) and ``/tokenize`` serves every render
from then on. Templates that print the tools' JSON usually differ (vLLM adds its own
defaults to each tool) and end up on ``/tokenize`` this way. What local rendering does not
attempt goes to ``/tokenize`` per call: content parts other than text, roles other than
system/user/assistant/tool, tool-call arguments that are not a JSON object's text, a
request's own ``chat_template`` or ``chat_template_kwargs``.

``transformers`` is optional (the ``train`` extra): without it ``LocalTemplate.load``
returns None and says why, and every render is ``/tokenize``'s, as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from rollq.schemas import ConfigError

log = structlog.get_logger("rollq.capture")

_ROLES = frozenset({"system", "user", "assistant", "tool"})

PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "Let me compute it.", "tool_calls": [
        {"id": "call-0", "type": "function",
         "function": {"name": "calculator", "arguments": "{\"expression\": \"6*7\"}"}}]},
    {"role": "tool", "tool_call_id": "call-0", "content": "42"},
    {"role": "assistant", "content": "It is 42.", "tool_calls": []},
    {"role": "user", "content": [{"type": "text", "text": "Thanks."},
                                 {"type": "text", "text": "And 6*8?"}]},
]
"""The conversation a local template is first checked on (with and without ``PROBE_TOOLS``)."""


class LocalTemplate:
    """A tokenizer and chat template rendering as the vLLM server does (module docstring)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def load(cls, tokenizer: str, chat_template: str | None = None) -> LocalTemplate | None:
        """The tokenizer at ``tokenizer`` (a local directory or hub id) with
        ``chat_template`` (a file or the template itself; None: the tokenizer's own), or
        None when ``transformers`` is not installed. ``ConfigError`` when either cannot be
        read."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            log.warning("capture_local_render_unavailable",
                        reason="transformers is not installed (the train extra): every chat "
                        "render goes to the server's /tokenize")
            return None
        template = chat_template
        if template is not None and "{" not in template:  # a file name, not a template
            if not Path(template).is_file():
                raise ConfigError(f"chat template {template!r}: no such file (give the "
                                  "template file the vLLM server was started with)")
            template = Path(template).read_text()
        try:
            return cls(AutoTokenizer.from_pretrained(tokenizer), template)
        except (OSError, ValueError) as exc:  # no such directory, not on the hub, offline
            raise ConfigError(f"tokenizer {tokenizer!r} cannot be loaded: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_options: Mapping[str, Any] | None = None) -> list[int] | None:
        """The token ids vLLM's ``/tokenize`` would give for these messages; None where
        local rendering does not attempt it (module docstring)."""
        if template_options:
            return None
        conversation = vllm_conversation(messages)
        if conversation is None:
            return None
        ids = self.tokenizer.apply_chat_template(
            conversation, tools=[dict(tool) for tool in tools] if tools else None,
            chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False)
        return [int(token) for token in ids]


def vllm_conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages as vLLM hands them to the template ("string" content format), or None
    when one holds something local rendering does not attempt."""
    conversation = []
    for message in messages:
        role = message.get("role")
        if role not in _ROLES:
            return None
        text = _text(message.get("content"))
        if text is None:
            return None
        item: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                parsed = _tool_calls(calls)
                if parsed is None:
                    return None
                if parsed:
                    item["tool_calls"] = parsed
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        conversation.append(item)
    return conversation


def _text(content: Any) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, Mapping) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str)
                                         for part in content):
        return "\n".join(part["text"] for part in content)
    return None


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list):
        return None
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            return None
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            return None  # the API says a JSON string: vLLM validates the request itself
        if arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None  # vLLM coerces these to {} with a warning: leave it to the server
        if not arguments:
            arguments = {}
        if not isinstance(arguments, dict):  # vLLM coerces these to {}: the server's call
            return None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed
