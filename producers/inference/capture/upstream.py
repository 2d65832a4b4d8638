"""Raw OpenAI-compatible requests through an ``InferencePool``, for the capture layer.

The pool's own ``chat``/``complete`` return ``Choice`` values; capture needs the whole
reply (tool calls, usage, the message as the server built it) to hand it back to an agent,
and ``/tokenize`` with ``tools``. ``Upstream.post`` sends one JSON body through the pool's
balancing, retries and pause handling (an aborted generation is resent after the pause,
like every pool call). It reaches the pool's request loop (``InferencePool._call``) and a
server's single request (``InferenceServer._post``): the pool has no public raw-request
method yet; one (``InferencePool.request(path, body)``) would remove this coupling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from producers.inference import GenerationAborted, InferencePool, InferenceServer
from producers.inference.parse import parse_tokens
from producers.inference.turns import probe_turn_end


class Upstream:
    """The vLLM servers behind one capture layer: a pool and what is learned from it once
    (the served model's name, the chat template's turn end). Shared by every episode."""

    def __init__(self, pool: InferencePool) -> None:
        self.pool = pool
        self._turn_end: list[int] | None = None
        self._lock = asyncio.Lock()

    async def model(self) -> str:
        """The served model's name (every request is sent with it, whatever the agent
        named: agent code often says ``gpt-4o``)."""
        return self.pool.model or (await self.pool.model_info()).name

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST path`` with ``body`` on the least loaded ready server; the JSON reply.

        Raises ``InferenceRequestError`` (4xx), ``InferenceUnavailable`` (after the
        pool's retries) or ``GenerationAborted`` (after ``max_aborts`` resends)."""

        async def attempt(server: InferenceServer) -> dict[str, Any]:
            reply = await server._post(path, body)
            if not isinstance(reply, dict):
                return {"value": reply}
            choices = reply.get("choices")
            if isinstance(choices, list) and any(
                    isinstance(choice, dict) and choice.get("finish_reason") == "abort"
                    for choice in choices):
                raise GenerationAborted(f"{path}: the server aborted the generation")
            return reply

        return await self.pool._call(path, attempt)

    async def render(self, messages: Sequence[dict[str, Any]], *,
                     tools: Sequence[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     template_options: dict[str, Any] | None = None) -> list[int]:
        """Token ids of ``messages`` through the server's chat template (``/tokenize``)."""
        body: dict[str, Any] = {"model": await self.model(), "messages": list(messages),
                                "add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            body["continue_final_message"] = True
        if tools:
            body["tools"] = list(tools)
        body.update(template_options or {})
        return parse_tokens(await self.post("/tokenize", body))

    async def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of plain ``text``; ``special`` adds the model's special tokens (BOS) as
        ``/v1/completions`` does for a text prompt, off for a continuation."""
        body = {"model": await self.model(), "prompt": text, "add_special_tokens": special}
        return parse_tokens(await self.post("/tokenize", body))

    async def turn_end(self) -> list[int]:
        """What the chat template writes after an assistant message's content."""
        if self._turn_end is None:
            async with self._lock:
                if self._turn_end is None:
                    _base, self._turn_end = await probe_turn_end(self.render)
        return self._turn_end
