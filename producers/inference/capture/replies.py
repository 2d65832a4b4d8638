"""OpenAI-shaped reply objects for the in-process ``EpisodeClient``.

Field names and meanings are the OpenAI API's (``openai.types.chat.ChatCompletion`` and
``openai.types.Completion``; a test validates these against the ``openai`` package's own
models). Foreign shapes: unknown fields the server adds (``refusal``, ``stop_reason``,
``prompt_token_ids``…) are kept (``extra="allow"``), not refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class FunctionCall(_Reply):
    name: str
    arguments: str
    """The arguments as a JSON string, as the model wrote them (parse before use)."""


class ToolCall(_Reply):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Reply):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    """vLLM's reasoning parser's split, when the server runs one."""


class Usage(_Reply):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatChoice(_Reply):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    """``stop``, ``length``, ``tool_calls``…"""
    logprobs: dict[str, Any] | None = None


class ChatCompletion(_Reply):
    """A ``/v1/chat/completions`` reply."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[ChatChoice]
    usage: Usage | None = None


class TextChoice(_Reply):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class TextCompletion(_Reply):
    """A ``/v1/completions`` reply."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[TextChoice]
    usage: Usage | None = None
