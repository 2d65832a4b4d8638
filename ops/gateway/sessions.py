"""The gateway's session routes (``rollq gateway --sessions``): ``producers.sessions.SessionHost``
over HTTP, for agents that run outside rollq's workers.

- ``POST /sessions`` (``OpenSessions``): open a group of ``group_size`` sessions of one
  prompt; ``{"group_id", "policy_version", "sessions": [{"session_id", "base_url"}]}``.
  A run without an admission slot answers **429** with ``Retry-After`` (seconds).
- ``POST /sessions/<id>/v1/chat/completions``, ``…/v1/completions``, ``GET …/v1/models``:
  the session's OpenAI base URL; an ``Idempotency-Key`` header (or ``Rollq-Call-Index``:
  the call's position in the session, 0 first) makes a retried call answer from the
  record.
- ``POST /sessions/<id>/close`` (``CloseSession``): ``{"session_id", "group_id",
  "closed", "group_size", "entry_id", "dead_letter"}``; ``entry_id`` is the group's traj
  entry once its last session closed.

Statuses: 400 a bad body or id, 404 a session that is not open (the message says whether
its group was published or dead-lettered), 409 a call on a closed session (or a
``Rollq-Call-Index`` past the calls captured, or a retry whose first try is still
generating after ``request_timeout_s``), 429 no
admission slot, 503 Redis or inference unavailable; the calls' own statuses as on
``/episodes`` (``producers.inference.capture.hub``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollq.producers.inference.capture.hub import (
    GatewayReply,
    answered,
    error_reply,
    json_body,
    models_reply,
    reply_of,
)
from rollq.producers.sessions import AdmissionRefused, SessionConflict, SessionHost
from rollq.schemas import BrokerUnavailable, ContractError


class OpenSessions(BaseModel):
    """The body of ``POST /sessions``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: str = Field(min_length=1, max_length=200)
    """The env name the group is published under (the scorers' and trainers' label)."""
    group_size: int = Field(default=1, ge=1, le=1024)
    """Sessions in the group: one sample each (GRPO's group)."""
    row: dict[str, Any] = Field(default_factory=dict)
    """The prompt's dataset row, kept as the group's metadata: e.g. ``answer``, which the
    scorers' accuracy component reads when the sessions are closed without a reward."""
    defaults: dict[str, Any] = Field(default_factory=dict)
    """Request fields every call gets where the agent sent none (e.g. ``temperature``)."""
    group_id: str | None = None
    """Choose the group's id (1-64 of ``A-Za-z0-9_-``) to make the open retryable: a
    second open with it returns the same sessions, admitted once. None: a new id."""
    run: str | None = None
    """The run, if the client wants it checked: it must be the gateway's ``--run``."""


class CloseSession(BaseModel):
    """The body of ``POST /sessions/<id>/close``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reward: float | None = None
    """The episode's reward (``Completion.info["env_score"]``, the reward bridge's
    ``env_score`` component); None: the scorers' other components score it."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Facts about the episode, kept as ``info["episode_metadata"]``."""


def add_session_routes(app: FastAPI) -> None:
    """The routes above; ``app.state.sessions`` holds the ``SessionHost`` (None: off)."""

    @app.post("/sessions")
    async def open_sessions(request: Request) -> Response:
        return await _respond(request, lambda host: _open(host, request))

    @app.post("/sessions/{session_id}/close")
    async def close_session(request: Request, session_id: str) -> Response:
        return await _respond(request, lambda host: _close(host, session_id, request))

    @app.api_route("/sessions/{session_id}/v1/{path:path}", methods=["GET", "POST"])
    async def session_call(request: Request, session_id: str, path: str) -> Response:
        return await _respond(request, lambda host: _call(host, session_id, path, request))


async def _respond(request: Request, work: Any) -> Response:
    host: SessionHost | None = getattr(request.app.state, "sessions", None)
    if host is None:
        reply = error_reply(404, "this gateway serves no sessions: start it with "
                            "`rollq gateway --sessions`", "not_found_error")
    else:
        try:
            reply = await answered(_conflicts(work(host)))
        except AdmissionRefused as exc:
            reply = error_reply(429, str(exc), "rate_limit_error")
            reply.headers["Retry-After"] = str(request.app.state.retry_after_s)
            host.counts.refused += 1
        except BrokerUnavailable as exc:
            reply = error_reply(503, str(exc), "service_unavailable")
    if reply.events is not None:
        return StreamingResponse(reply.events, status_code=reply.status,
                                 media_type="text/event-stream")
    return Response(reply.content(), status_code=reply.status, headers=reply.headers,
                    media_type="application/json")


async def _conflicts(work: Awaitable[GatewayReply]) -> GatewayReply:
    try:
        return await work
    except SessionConflict as exc:
        return error_reply(409, str(exc), "conflict_error")


async def _body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        return model.model_validate(orjson.loads(raw) if raw else {})
    except (ValueError, ValidationError) as exc:
        raise _BadRequest(str(exc)) from exc


class _BadRequest(ContractError):
    pass


async def _open(host: SessionHost, request: Request) -> GatewayReply:
    try:
        body: OpenSessions = await _body(request, OpenSessions)
        if body.run is not None and body.run != host.run:
            raise _BadRequest(f"this gateway serves run {host.run!r}, not {body.run!r}")
        opened = await host.open(body.env, group_size=body.group_size, row=body.row,
                                 defaults=body.defaults, group_id=body.group_id)
    except ContractError as exc:
        return error_reply(400, str(exc), "invalid_request_error")
    base = str(request.base_url).rstrip("/")
    return GatewayReply(body={
        "group_id": opened.group_id, "run": host.run, "policy_version": opened.policy_version,
        "opened": opened.opened,
        "sessions": [{"session_id": session, "base_url": f"{base}/sessions/{session}/v1"}
                     for session in opened.session_ids]})


async def _close(host: SessionHost, session_id: str, request: Request) -> GatewayReply:
    try:
        body: CloseSession = await _body(request, CloseSession)
    except _BadRequest as exc:
        return error_reply(400, str(exc), "invalid_request_error")
    outcome = await host.close(session_id, reward=body.reward, metadata=body.metadata)
    return GatewayReply(body={
        "session_id": outcome.session_id, "group_id": outcome.group_id,
        "closed": outcome.closed, "group_size": outcome.group_size,
        "entry_id": outcome.entry_id, "dead_letter": outcome.dead_letter})


async def _call(host: SessionHost, session_id: str, path: str,
                request: Request) -> GatewayReply:
    route: Literal["chat", "completions"]
    if request.method == "GET" and path.rstrip("/") == "models":
        return await models_reply(host.upstream)
    if request.method == "POST" and path.rstrip("/") == "chat/completions":
        route = "chat"
    elif request.method == "POST" and path.rstrip("/") == "completions":
        route = "completions"
    else:
        return error_reply(404, f"no route {request.method} /v1/{path}", "not_found_error")
    body = json_body(await request.body())
    if isinstance(body, GatewayReply):
        return body
    position = request.headers.get("rollq-call-index")
    if position is not None and not position.isdigit():
        return error_reply(400, "Rollq-Call-Index must be a call's position (0, 1, ...)",
                           "invalid_request_error")
    reply = await host.call(session_id, route, body,
                            idempotency_key=request.headers.get("idempotency-key"),
                            call_index=None if position is None else int(position))
    return reply_of(body, reply, chat=route == "chat")
