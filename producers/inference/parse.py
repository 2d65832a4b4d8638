"""Parse vLLM's OpenAI-compatible response bodies into ``Choice`` values.

Shapes are those of vLLM 0.32 (see ``tests/fixtures/vllm``):

- ``/v1/completions``: per choice ``token_ids``, ``prompt_token_ids`` and
  ``logprobs.token_logprobs`` (one float per generated token). With
  ``return_tokens_as_token_ids`` the ``logprobs.tokens`` are ``"token_id:N"`` strings; they
  are checked against ``token_ids`` when present.
- ``/v1/chat/completions``: per choice ``token_ids`` and ``logprobs.content[i].logprob``;
  ``prompt_token_ids`` sits at the top level; ``message.reasoning`` (or the older
  ``reasoning_content``) holds the reasoning parser's split.
- ``/inference/v1/generate`` (vLLM's token-in API, ``--enable-scale-out``) with
  ``output_mode: "text"``: per choice ``token_ids``, ``text``, ``logprobs.content[i].logprob``
  and ``weight_versions`` (spans of output tokens per weight label); no prompt ids (the
  caller has them: they are what it sent, from ``/v1/completions/render``).
- With ``--enable-return-routed-experts`` (MoE models), each choice's ``routed_experts``:
  base64 of a ``.npy`` array ``[prompt + completion - 1, layers, top_k]`` (uint8/uint16).
- Errors: ``{"error": {"message", "type", "param", "code"}}``, or FastAPI's
  ``{"detail": ...}`` for unknown routes.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from rollq.producers.inference.errors import InferenceResponseError
from rollq.producers.inference.params import Choice, WeightSpan

_TOKEN_ID_PREFIX = "token_id:"


def parse_completions(body: Any) -> list[Choice]:
    """Samples of a ``/v1/completions`` response, in choice-index order."""
    samples = []
    for choice in _choices(body):
        token_ids = _token_ids(choice)
        logprobs_block = choice.get("logprobs")
        if not isinstance(logprobs_block, dict):
            raise InferenceResponseError("completion choice has no logprobs (request logprobs=0)")
        logprobs = _floats(logprobs_block.get("token_logprobs"), len(token_ids))
        tokens = logprobs_block.get("tokens")
        if isinstance(tokens, list) and all(
            isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens
        ):
            if [int(t[len(_TOKEN_ID_PREFIX):]) for t in tokens] != token_ids:
                raise InferenceResponseError("logprobs.tokens disagree with token_ids")
        prompt_ids = _ints(choice.get("prompt_token_ids"), "prompt_token_ids")
        samples.append(Choice(
            prompt_ids=prompt_ids,
            completion_ids=token_ids,
            logprobs=logprobs,
            finish_reason=str(choice.get("finish_reason") or ""),
            text=str(choice.get("text") or ""),
            stop_reason=choice.get("stop_reason"),
            routed_experts=_routed(choice, len(prompt_ids) + len(token_ids) - 1),
        ))
    return samples


def parse_chat(body: Any) -> list[Choice]:
    """Samples of a ``/v1/chat/completions`` response, in choice-index order."""
    prompt_ids = _ints(body.get("prompt_token_ids"), "prompt_token_ids")
    samples = []
    for choice in _choices(body):
        token_ids = _token_ids(choice)
        logprobs = _content_logprobs(choice, len(token_ids), "chat choice", "logprobs=true")
        message = choice.get("message") or {}
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        samples.append(Choice(
            prompt_ids=prompt_ids,
            completion_ids=token_ids,
            logprobs=logprobs,
            finish_reason=str(choice.get("finish_reason") or ""),
            text=str(message.get("content") or ""),
            reasoning=str(reasoning) if reasoning is not None else None,
            stop_reason=choice.get("stop_reason"),
            routed_experts=_routed(choice, len(prompt_ids) + len(token_ids) - 1),
        ))
    return samples


def parse_generate(body: Any, prompt_ids: list[int]) -> list[Choice]:
    """Samples of an ``/inference/v1/generate`` response (``output_mode: "text"``)."""
    samples = []
    for choice in _choices(body):
        token_ids = _token_ids(choice)
        logprobs = _content_logprobs(choice, len(token_ids), "generate choice", "logprobs=0")
        samples.append(Choice(
            prompt_ids=prompt_ids,
            completion_ids=token_ids,
            logprobs=logprobs,
            finish_reason=str(choice.get("finish_reason") or ""),
            text=str(choice.get("text") or ""),
            stop_reason=choice.get("stop_reason"),
            weight_versions=_spans(choice.get("weight_versions"), len(token_ids)),
            routed_experts=_routed(choice, len(prompt_ids) + len(token_ids) - 1),
        ))
    return samples


def parse_tokens(body: Any) -> list[int]:
    """Token ids of a ``/tokenize`` response."""
    if not isinstance(body, dict):
        raise InferenceResponseError("tokenize response is not an object")
    return _ints(body.get("tokens"), "tokens")


def error_detail(body: Any, fallback: str) -> tuple[str, str | None]:
    """``(message, param)`` of an error body; ``fallback`` when it has neither shape."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            param = error.get("param")
            return str(error["message"]), str(param) if param is not None else None
        if "detail" in body:
            return str(body["detail"]), None
    return fallback, None


def _choices(body: Any) -> list[dict[str, Any]]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        raise InferenceResponseError("response has no choices")
    return sorted(choices, key=lambda choice: int(choice.get("index", 0)))


def _token_ids(choice: dict[str, Any]) -> list[int]:
    if choice.get("token_ids") is None:
        raise InferenceResponseError(
            "response has no token_ids: the server must support return_token_ids (vLLM >= 0.10.2)")
    return _ints(choice["token_ids"], "token_ids")


def _content_logprobs(choice: dict[str, Any], expected: int, what: str,
                      asked: str) -> list[float]:
    """The sampled tokens' logprobs of a choice's ``logprobs.content`` (chat and generate
    share the shape); ``asked`` names the request field that makes the server send them."""
    block = choice.get("logprobs")
    content = block.get("content") if isinstance(block, dict) else None
    if not isinstance(content, list):
        raise InferenceResponseError(f"{what} has no logprobs.content ({asked})")
    return _floats([entry.get("logprob") for entry in content], expected)


def _ints(values: Any, name: str) -> list[int]:
    if not isinstance(values, list) or not {*map(type, values)} <= {int}:
        raise InferenceResponseError(f"{name} is not a list of token ids")
    return values


def _floats(values: Any, expected: int) -> list[float]:
    if not isinstance(values, list) or len(values) != expected:
        got = len(values) if isinstance(values, list) else values
        raise InferenceResponseError(f"expected {expected} token logprobs, got {got}")
    # one set of types instead of an isinstance per token: replies carry thousands
    if not {*map(type, values)} <= {float, int}:
        raise InferenceResponseError("token logprobs contain non-numbers")
    return list(map(float, values))


def _spans(values: Any, count: int) -> tuple[WeightSpan, ...] | None:
    """The weight spans of a generate choice, checked to tile ``[0, count)`` in order."""
    if values is None:
        return None
    if not isinstance(values, list):
        raise InferenceResponseError("weight_versions is not a list")
    spans, position = [], 0
    for value in values:
        if not isinstance(value, dict):
            raise InferenceResponseError("weight_versions holds a non-object")
        start, end = value.get("start"), value.get("end")
        if start != position or not isinstance(end, int) or end < start:
            raise InferenceResponseError(f"weight_versions do not tile the output: {values}")
        spans.append(WeightSpan(str(value.get("version")), start, end))
        position = end
    if position != count:
        raise InferenceResponseError(f"weight_versions cover {position} of {count} tokens")
    return tuple(spans)


def _routed(choice: dict[str, Any], positions: int) -> Any:
    """A choice's routed experts (``[positions, layers, top_k]``), or None when it has none."""
    encoded = choice.get("routed_experts")
    if encoded is None:
        return None
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)),
                        allow_pickle=False)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise InferenceResponseError(f"routed_experts is not a base64 .npy array: {exc}") from None
    if array.ndim != 3 or array.shape[0] != positions:
        raise InferenceResponseError(f"routed_experts has shape {array.shape}, expected "
                                     f"[{positions}, layers, top_k]")
    return array
