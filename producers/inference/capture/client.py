"""``EpisodeClient``: the model as an episode sees it, with the ``openai`` client's surface.

    reply = await client.chat.completions.create(messages=..., tools=..., temperature=...)
    reply.choices[0].message.content, reply.choices[0].message.tool_calls,
    reply.choices[0].finish_reason, reply.usage

    reply = await client.completions.create(prompt="..." or [token ids], max_tokens=...)

Every call goes through the episode's ``EpisodeCapture``. ``model`` may be given and is
ignored (the served model answers); ``extra_body`` is merged into the request like the
``openai`` client does; ``extra_headers``, ``extra_query`` and ``timeout`` are accepted and
ignored. Streaming is the gateway's (``stream=True`` is refused here). Errors are rollq's:
``InferenceUnavailable`` (retry the job), ``InferenceRequestError`` (4xx; a
``PromptTooLongError`` when the context is full: an agent may end its episode on it).
"""

from __future__ import annotations

from typing import Any

from rollq.producers.inference.capture.replies import ChatCompletion, TextCompletion
from rollq.producers.inference.capture.session import EpisodeCapture
from rollq.producers.inference.errors import InferenceRequestError

_IGNORED = ("model", "extra_headers", "extra_query", "timeout")


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    if fields.get("stream"):
        raise InferenceRequestError("the in-process episode client does not stream; agents "
                                    "that stream use the gateway", status=400, param="stream")
    extra = fields.pop("extra_body", None) or {}
    body = {key: value for key, value in fields.items()
            if key not in _IGNORED and value is not None}
    body.update(extra)
    return body


class _ChatCompletions:
    def __init__(self, capture: EpisodeCapture) -> None:
        self._capture = capture

    async def create(self, *, messages: list[Any], **fields: Any) -> ChatCompletion:
        """One chat call (OpenAI's parameters: ``tools``, ``tool_choice``, ``temperature``,
        ``max_tokens``, ``logprobs``, ``seed``, ``stop``… and vLLM's extras)."""
        reply = await self._capture.chat({**_body(fields), "messages": list(messages)})
        return ChatCompletion.model_validate(reply)


class _Chat:
    def __init__(self, capture: EpisodeCapture) -> None:
        self.completions = _ChatCompletions(capture)


class _Completions:
    def __init__(self, capture: EpisodeCapture) -> None:
        self._capture = capture

    async def create(self, *, prompt: str | list[int], **fields: Any) -> TextCompletion:
        """One text completion of ``prompt`` (text, or token ids used verbatim)."""
        reply = await self._capture.complete({**_body(fields), "prompt": prompt})
        return TextCompletion.model_validate(reply)


class EpisodeClient:
    """The LLM client an episode gets (module docstring); ``capture`` holds its calls."""

    def __init__(self, capture: EpisodeCapture) -> None:
        self.capture = capture
        self.chat = _Chat(capture)
        self.completions = _Completions(capture)
