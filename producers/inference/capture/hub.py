"""``CaptureHub``: the capturing gateway's core, free of any web framework.

It keeps the open episodes by id and answers the gateway's routes (``dispatch``), so the
same code serves the HTTP gateway (``ops.gateway``) and the in-process transport
(``capture.gateways.CaptureTransport``):

- ``POST /episodes`` (body optional: ``{"episode_id": ..., "defaults": {...}}``) opens an
  episode: ``{"episode_id", "base_path": "/episodes/<id>/v1"}``;
- ``POST /episodes/<id>/close`` closes it: the ``CapturedEpisode`` (sequences, counters);
- ``POST /episodes/<id>/v1/chat/completions`` and ``…/v1/completions``: captured calls;
  ``GET /episodes/<id>/v1/models`` and ``GET /v1/models``: the served model;
- ``POST /v1/chat/completions`` and ``/v1/completions``: the same proxy, uncaptured;
- ``GET /health``: the open episodes, and how chat renders were made (``local``: by the
  gateway's own template, ``server``: ``/tokenize``, ``mismatches``: local renders that
  differed from the server's, ``capture.render``).

With ``"stream": true`` the reply is sent as server-sent events: the whole reply in one
content chunk (and one tool-call chunk), then the finish chunk, the usage chunk when
``stream_options.include_usage`` is set, and ``[DONE]``. The gateway waits for the whole
generation because it records it and because the pool may resend it (after a server
aborted it for a weight update): a half-streamed answer could not be taken back.

Errors answer in OpenAI's error shape: the server's own 4xx status and message for a
rejected request, 503 when inference is unavailable (after the pool's retries), 404 for an
unknown or closed episode, 400 for a body that is not JSON, 502 when a server's reply
lacks what capture needs. An episode idle for ``episode_ttl_s`` is closed and dropped by
``expire`` (its calls are lost and counted in ``expired``): a worker that died mid-episode
does not leak memory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from rollq.producers.inference.capture.record import CapturedEpisode
from rollq.producers.inference.capture.session import (
    ContinuationCheck,
    EpisodeCapture,
    EpisodeClosed,
)
from rollq.producers.inference.capture.upstream import Upstream
from rollq.producers.inference.errors import InferenceRequestError
from rollq.schemas import ContractError, InferenceUnavailable

log = structlog.get_logger("rollq.gateway")


class UnknownEpisode(EpisodeClosed):
    """No open episode has this id (never opened, closed, or expired)."""


@dataclass
class GatewayReply:
    """An answer of ``CaptureHub.dispatch``: a JSON body, or server-sent events."""

    status: int = 200
    body: Any = None
    events: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return orjson.dumps(self.body)


class CaptureHub:
    """Open episodes by id, and the gateway's routes (module docstring)."""

    def __init__(self, upstream: Upstream, *, defaults: Mapping[str, Any] | None = None,
                 policy_version: Callable[[], Awaitable[int]] | None = None,
                 episode_ttl_s: float = 3600.0, tool_parser: str | None = "hermes",
                 continuation_check: ContinuationCheck = "before") -> None:
        self.upstream = upstream
        self.defaults = dict(defaults or {})
        self.policy_version = policy_version
        self.episode_ttl_s = episode_ttl_s
        self.tool_parser = tool_parser
        self.continuation_check: ContinuationCheck = continuation_check
        self.episodes: dict[str, EpisodeCapture] = {}
        self.opened = self.closed = self.expired = 0

    def open(self, episode_id: str | None = None, *,
             defaults: Mapping[str, Any] | None = None,
             policy_version: Callable[[], Awaitable[int]] | None = None) -> EpisodeCapture:
        """Start capturing a new episode; ``defaults`` add to the hub's for this one."""
        self.expire()
        episode_id = episode_id or uuid.uuid4().hex
        if episode_id in self.episodes:
            raise ContractError(f"episode {episode_id!r} is already open")
        capture = EpisodeCapture(self.upstream, episode_id=episode_id,
                                 defaults={**self.defaults, **(defaults or {})},
                                 policy_version=policy_version or self.policy_version,
                                 tool_parser=self.tool_parser,
                                 continuation_check=self.continuation_check)
        self.episodes[episode_id] = capture
        self.opened += 1
        return capture

    def get(self, episode_id: str) -> EpisodeCapture:
        try:
            return self.episodes[episode_id]
        except KeyError:
            raise UnknownEpisode(f"no open episode {episode_id!r}") from None

    def close(self, episode_id: str) -> CapturedEpisode:
        """Close an episode and forget it; its capture."""
        captured = self.get(episode_id).close()
        del self.episodes[episode_id]
        self.closed += 1
        log.info("episode_closed", episode=episode_id, sequences=len(captured.sequences),
                 calls=captured.stats.calls, text_drift=captured.stats.text_drift)
        return captured

    def expire(self, now: float | None = None) -> list[str]:
        """Close and drop the episodes idle for longer than ``episode_ttl_s``."""
        now = time.monotonic() if now is None else now
        stale = [episode_id for episode_id, capture in self.episodes.items()
                 if now - capture.last_used > self.episode_ttl_s]
        for episode_id in stale:
            self.episodes.pop(episode_id).close()
            self.expired += 1
            log.warning("episode_expired", episode=episode_id, ttl_s=self.episode_ttl_s)
        return stale

    # --- routes --------------------------------------------------------------------------

    async def dispatch(self, method: str, path: str, content: bytes | None) -> GatewayReply:
        """Answer one request (module docstring); never raises for a bad request."""
        body = json_body(content)
        if isinstance(body, GatewayReply):
            return body
        return await answered(self._route(method, path.rstrip("/"), body))

    async def _route(self, method: str, path: str, body: dict[str, Any]) -> GatewayReply:
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/health":
            upstream = self.upstream
            return GatewayReply(body={"status": "ok", "episodes": len(self.episodes),
                                      "renders": {"local": upstream.local_renders,
                                                  "server": upstream.server_renders,
                                                  "mismatches": upstream.render_mismatches}})
        if parts[0] == "episodes":
            if method == "POST" and len(parts) == 1:
                capture = self.open(body.get("episode_id"), defaults=body.get("defaults"))
                return GatewayReply(body={"episode_id": capture.episode_id,
                                          "base_path": f"/episodes/{capture.episode_id}/v1"})
            if method == "POST" and len(parts) == 3 and parts[2] == "close":
                return GatewayReply(body=self.close(parts[1]).model_dump(mode="json"))
            if len(parts) >= 3 and parts[2] == "v1":
                return await self._api(method, "/" + "/".join(parts[2:]), body,
                                       self.get(parts[1]))
        elif parts[0] == "v1":
            return await self._api(method, path, body, None)
        return error_reply(404, f"no route {method} {path}", "not_found_error")

    async def _api(self, method: str, path: str, body: dict[str, Any],
                   capture: EpisodeCapture | None) -> GatewayReply:
        if method == "GET" and path == "/v1/models":
            return await models_reply(self.upstream)
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return error_reply(404, f"no route {method} {path}", "not_found_error")
        session = capture or EpisodeCapture(self.upstream, defaults=self.defaults,
                                            tool_parser=self.tool_parser)
        chat = path == "/v1/chat/completions"
        reply = await (session.chat(body) if chat else session.complete(body))
        return reply_of(body, reply, chat=chat)


def json_body(content: bytes | None) -> dict[str, Any] | GatewayReply:
    """A request's JSON object (none: ``{}``), or the 400 reply for a body that is not one."""
    try:
        body = orjson.loads(content) if content else {}
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
    except ValueError as exc:
        return error_reply(400, f"invalid JSON body: {exc}", "invalid_request_error")
    return body


async def answered(work: Awaitable[GatewayReply]) -> GatewayReply:
    """``work``'s reply, or the error reply of what it raised (module docstring)."""
    try:
        return await work
    except EpisodeClosed as exc:
        return error_reply(404, str(exc), "not_found_error")
    except InferenceRequestError as exc:
        return error_reply(exc.status, exc.server_message, "invalid_request_error", exc.param)
    except InferenceUnavailable as exc:
        return error_reply(503, f"inference unavailable: {exc}", "service_unavailable")
    except ContractError as exc:
        return error_reply(502, str(exc), "upstream_error")


async def models_reply(upstream: Upstream) -> GatewayReply:
    """``GET /v1/models``: the one model served."""
    info = await upstream.pool.model_info()
    return GatewayReply(body={"object": "list", "data": [{
        "id": info.name, "object": "model", "created": 0, "owned_by": "rollq",
        "max_model_len": info.max_model_len}]})


def reply_of(body: dict[str, Any], reply: dict[str, Any], *, chat: bool) -> GatewayReply:
    """A call's reply as the agent asked for it: one JSON body, or server-sent events."""
    if not body.get("stream"):
        return GatewayReply(body=reply)
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return GatewayReply(events=stream_events(reply, chat=chat, include_usage=usage),
                        headers={"content-type": "text/event-stream"})


def stream_events(reply: dict[str, Any], *, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """A whole reply as OpenAI streaming chunks (server-sent events)."""

    async def events() -> AsyncIterator[bytes]:
        head = {"id": reply.get("id", ""), "created": reply.get("created", 0),
                "model": reply.get("model", ""),
                "object": "chat.completion.chunk" if chat else "text_completion"}
        for choice in reply.get("choices") or []:
            index = choice.get("index", 0)
            if chat:
                message = choice.get("message") or {}
                yield _event({**head, "choices": [{"index": index, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]})
                delta: dict[str, Any] = {}
                if message.get("content"):
                    delta["content"] = message["content"]
                if message.get("reasoning"):
                    delta["reasoning"] = message["reasoning"]
                if delta or choice.get("logprobs"):
                    yield _event({**head, "choices": [{"index": index, "delta": delta,
                                                       "logprobs": choice.get("logprobs"),
                                                       "finish_reason": None}]})
                calls = message.get("tool_calls") or []
                if calls:
                    yield _event({**head, "choices": [{"index": index, "delta": {"tool_calls": [
                        {"index": i, **call} for i, call in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None}]})
                final = {"index": index, "delta": {}, "logprobs": None,
                         "finish_reason": choice.get("finish_reason")}
            else:
                final = {"index": index, "text": choice.get("text", ""),
                         "logprobs": choice.get("logprobs"),
                         "finish_reason": choice.get("finish_reason")}
            for key in ("token_ids", "stop_reason"):
                if key in choice:
                    final[key] = choice[key]
            yield _event({**head, "choices": [final]})
        if include_usage:
            yield _event({**head, "choices": [], "usage": reply.get("usage")})
        yield b"data: [DONE]\n\n"

    return events()


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def error_reply(status: int, message: str, kind: str,
                param: str | None = None) -> GatewayReply:
    """An error in OpenAI's shape."""
    return GatewayReply(status=status, body={"error": {
        "message": message, "type": kind, "param": param, "code": status}})
