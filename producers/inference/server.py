"""One vLLM server: single-attempt calls of its OpenAI-compatible API, and its pool state.

This module is where httpx meets rollq: every httpx exception and every non-2xx status is
translated here (``producers.inference.errors`` documents the branches). Retries, balancing
and pause waiting are the pool's business; a call here is exactly one HTTP request.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import httpx
import orjson

from producers.inference.errors import (
    GenerationAborted,
    InferenceRequestError,
    InferenceResponseError,
    PromptTooLongError,
    ServerUnreachable,
)
from producers.inference.params import Sample, SamplingParams
from producers.inference.parse import error_detail, parse_chat, parse_completions, parse_tokens
from schemas import InferenceUnavailable

Message = dict[str, Any]

_RETRYABLE_4XX = frozenset({408, 409, 425, 429})


class InferenceServer:
    """Client of one server's API, plus the state the pool balances on.

    ``outstanding`` (requests in flight), ``healthy``, ``unhealthy_reason`` (why the last
    probe or request found it down: URL and cause, for log lines and errors) and ``paused``
    are maintained by ``InferencePool``; the calls themselves never change them.
    """

    def __init__(self, base_url: str, client: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.outstanding = 0
        self.healthy = True
        self.unhealthy_reason: str | None = None
        self.paused = False
        self.pause_supported = True

    def __repr__(self) -> str:
        return (f"InferenceServer({self.base_url!r}, outstanding={self.outstanding}, "
                f"healthy={self.healthy}, paused={self.paused})")

    async def complete(self, prompt: str | Sequence[int], n: int, params: SamplingParams, *,
                       model: str) -> list[Sample]:
        """``/v1/completions`` with n choices; the prompt is text or token ids."""
        body = {
            **params.body(),
            "model": model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        samples = parse_completions(await self._post("/v1/completions", body))
        self._check_not_aborted(samples)
        return samples

    async def chat(self, messages: Sequence[Message], n: int, params: SamplingParams, *,
                   model: str) -> list[Sample]:
        """``/v1/chat/completions`` with n choices; the server applies its chat template."""
        body = {
            **params.body(),
            "model": model,
            "messages": list(messages),
            "n": n,
            "logprobs": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        samples = parse_chat(await self._post("/v1/chat/completions", body))
        self._check_not_aborted(samples)
        return samples

    async def tokenize(self, *, model: str, messages: Sequence[Message] | None = None,
                       prompt: str | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       add_special_tokens: bool | None = None) -> list[int]:
        """``/tokenize`` of chat messages (through the chat template) or of plain text."""
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body["messages"] = list(messages)
            body["add_generation_prompt"] = add_generation_prompt
            if continue_final_message:
                body["continue_final_message"] = True
        elif prompt is not None:
            body["prompt"] = prompt
        else:
            raise ValueError("tokenize needs messages or prompt")
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        return parse_tokens(await self._post("/tokenize", body))

    async def models(self) -> list[dict[str, Any]]:
        """The ``data`` list of ``/v1/models``."""
        body = await self._request("GET", "/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not data:
            raise InferenceResponseError("/v1/models lists no model")
        return data

    async def health(self) -> bool:
        """True when ``/health`` answers 2xx; False on any error (never raises)."""
        return await self.health_failure() is None

    async def health_failure(self) -> str | None:
        """None when ``/health`` answers 2xx, else why not (URL and cause; never raises)."""
        url = self.base_url + "/health"
        try:
            response = await self.client.get(url)
        except httpx.HTTPError as exc:
            return f"GET {url}: {type(exc).__name__}: {exc}"
        if response.is_success:
            return None
        return f"GET {url} answered {response.status_code}"

    async def is_paused(self) -> bool:
        """``/is_paused``; False on servers without the route (vLLM before pause support)."""
        try:
            body = await self._request("GET", "/is_paused")
        except InferenceRequestError as exc:
            if exc.status == 404:
                self.pause_supported = False
                return False
            raise
        return bool(body.get("is_paused")) if isinstance(body, dict) else False

    @staticmethod
    def _check_not_aborted(samples: list[Sample]) -> None:
        # One aborted choice spoils the group: its tokens stop mid-way under an old policy.
        aborted = sum(sample.finish_reason == "abort" for sample in samples)
        if aborted:
            raise GenerationAborted(f"{aborted} of {len(samples)} choices aborted by the server")

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base_url + path
        try:
            response = await self.client.request(
                method, url, content=orjson.dumps(body) if body is not None else None,
                headers={"content-type": "application/json"} if body is not None else None,
            )
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
                httpx.WriteError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise InferenceUnavailable(f"{method} {url} timed out: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise InferenceUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        try:
            payload = _loads(response.content) if response.content else None
        except orjson.JSONDecodeError as exc:
            if response.is_success:
                raise InferenceUnavailable(f"{method} {url}: truncated JSON body") from exc
            payload = None
        if response.is_success:
            return payload
        message, param = error_detail(payload, response.text[:500] or response.reason_phrase)
        if 400 <= status < 500 and status not in _RETRYABLE_4XX:
            error = PromptTooLongError if param == "input_tokens" else InferenceRequestError
            raise error(message, status=status, param=param)
        raise InferenceUnavailable(f"{method} {url} answered {status}: {message}")


def _loads(body: bytes) -> Any:
    """orjson.loads with the cyclic garbage collector paused: a 8 × 1,024-token reply makes
    ~50k objects, and collections triggered while they are built cost 4x the parse (the
    decoded JSON has no reference cycles, so pausing loses nothing)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body)
    finally:
        if enabled:
            gc.enable()
