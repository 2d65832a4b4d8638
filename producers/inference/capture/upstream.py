"""Raw OpenAI-compatible requests through an ``InferencePool``, for the capture layer.

The pool's own ``chat``/``complete`` return ``Choice`` values; capture needs the whole
reply (tool calls, usage, the message as the server built it) to hand it back to an agent,
and ``/tokenize`` with ``tools``. ``Upstream.post`` sends one JSON body through the pool's
balancing, retries and pause handling (an aborted generation is resent after the pause,
like every pool call). It reaches the pool's request loop (``InferencePool._call``) and a
server's single request (``InferenceServer._post``): the pool has no public raw-request
method yet; one (``InferencePool.request(path, body)``) would remove this coupling.

``render`` goes through a ``LocalTemplate`` when one is given (``capture.render``: the
same ids without a request to the server, checked against ``/tokenize`` on a probe and on
the first ``verify`` renders, dropped for good on any difference).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rollq.producers.inference import GenerationAborted, InferencePool, InferenceServer
from rollq.producers.inference.capture.render import PROBE_MESSAGES, PROBE_TOOLS, LocalTemplate
from rollq.producers.inference.errors import InferenceRequestError
from rollq.producers.inference.parse import parse_tokens
from rollq.producers.inference.turns import probe_turn_end

log = structlog.get_logger("rollq.capture")


class Upstream:
    """The vLLM servers behind one capture layer: a pool and what is learned from it once
    (the served model's name, the chat template's turn end). Shared by every episode.

    ``template``: renders chat messages in this process (module docstring); ``verify``:
    how many of its renders are also asked of the server before it is trusted alone."""

    def __init__(self, pool: InferencePool, *, template: LocalTemplate | None = None,
                 verify: int = 16) -> None:
        self.pool = pool
        self.template = template
        self.verify = verify
        self.local_renders = self.server_renders = self.render_mismatches = 0
        """Renders answered locally, by ``/tokenize``, and local renders that differed."""
        self._probed: asyncio.Task[None] | None = None
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
        """Token ids of ``messages`` through the server's chat template: the local
        template's once it has passed its checks, else ``/tokenize``'s."""
        shape = _Shape(tools, add_generation_prompt, continue_final_message, template_options)
        if self.template is not None:
            probe = self._probed
            if probe is None or (probe.done() and not probe.cancelled()
                                 and probe.exception() is not None):
                probe = self._probed = asyncio.create_task(self._probe())
            await asyncio.shield(probe)
        ids = self._render_locally(messages, shape)
        if ids is None:
            return await self._render_on_server(messages, shape)
        if self.verify <= 0:
            self.local_renders += 1
            return ids
        self.verify -= 1
        served = await self._render_on_server(messages, shape)
        if served == ids:
            self.local_renders += 1
        else:
            self._drop_template(ids, served, "a render")
        return served

    def _render_locally(self, messages: Sequence[dict[str, Any]],
                        shape: _Shape) -> list[int] | None:
        if self.template is None:
            return None
        try:
            return self.template.render(
                messages, tools=shape.tools, add_generation_prompt=shape.generation,
                continue_final_message=shape.continue_final, template_options=shape.options)
        except Exception as exc:  # a template error: the server answers it (its 4xx)
            log.info("capture_local_render_failed", error=f"{type(exc).__name__}: {exc}")
            return None

    async def _probe(self) -> None:
        """Compare the local template with the server's on ``PROBE_MESSAGES`` (with and
        without tools, with and without the generation prompt) before it is used."""
        for tools in (PROBE_TOOLS, None):
            for generation in (True, False):
                shape = _Shape(tools, generation, False, None)
                try:
                    served = await self._render_on_server(PROBE_MESSAGES, shape)
                except InferenceRequestError as exc:  # the server's template refused it
                    log.info("capture_local_render_probe_refused", error=str(exc))
                    served = []
                local = self._render_locally(PROBE_MESSAGES, shape)
                if local is None or local != served:
                    self._drop_template(local or [], served, "the probe conversation")
                    return

    def _drop_template(self, local: list[int], served: list[int], what: str) -> None:
        if self.template is None:
            return
        self.template = None
        self.render_mismatches += 1
        at = next((i for i, (a, b) in enumerate(zip(local, served, strict=False)) if a != b),
                  min(len(local), len(served)))
        log.warning("capture_local_render_disabled", on=what, at_token=at,
                    reason="the local chat template rendered differently from the server's "
                    "/tokenize: every render goes to the server from now on")

    async def _render_on_server(self, messages: Sequence[dict[str, Any]],
                                shape: _Shape) -> list[int]:
        self.server_renders += 1
        body: dict[str, Any] = {"model": await self.model(), "messages": list(messages),
                                "add_generation_prompt": shape.generation}
        if shape.continue_final:
            body["continue_final_message"] = True
        if shape.tools:
            body["tools"] = list(shape.tools)
        body.update(shape.options or {})
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


@dataclass(frozen=True)
class _Shape:
    """How a conversation is rendered (``Upstream.render``'s options)."""

    tools: Sequence[dict[str, Any]] | None
    generation: bool
    continue_final: bool
    options: dict[str, Any] | None
