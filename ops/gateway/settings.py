"""Settings of ``rollq gateway``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollq.ops.settings import CommonSettings, InferenceUrls


class GatewaySettings(CommonSettings):
    """The capturing gateway in front of one model's vLLM servers (it uses Redis only with
    ``sessions``: ``redis_url``, ``run`` and ``partitions`` then say where)."""

    section: str = Field(default="gateway", exclude=True, repr=False)
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface)."""
    port: int = Field(default=8100, ge=0, le=65535)
    """Port to listen on."""
    inference: InferenceUrls = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vLLM base URLs (one model); balanced, health-checked, paused-aware like a worker's."""
    model: str | None = None
    """Served model name; None: asked from ``/v1/models``. Every request is sent with it."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one generation."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a failed upstream call before the agent gets a 503."""
    episode_ttl_s: float = Field(default=3600.0, gt=0)
    """An episode with no call and no close for this long is dropped (its worker died)."""
    tool_parser: str | None = "hermes"
    """How replies of token-in chat calls find tool calls: ``hermes`` or None."""
    tokenizer: str | None = None
    """The served model's tokenizer (a local directory or hub id): with ``transformers``
    installed, chat continuations are rendered in the gateway instead of by two
    ``/tokenize`` requests each (checked against the server first, ``capture.render``);
    None: always ``/tokenize``."""
    chat_template: str | None = None
    """The chat template the vLLM server was started with (``--chat-template``: a file or
    the template), used with ``tokenizer``; None: the tokenizer's own."""
    continuation_check: Literal["before", "after"] = "before"
    """When a chat continuation is checked for re-tokenisation: ``before`` renders the
    conversation through ``/tokenize`` first (two renders per continuation, about 3 ms each
    on an idle server; no generation is ever discarded); ``after`` sends it at once and
    checks the prompt ids the server reports (no extra request when the template reproduces
    the earlier tokens; on drift the generation is discarded and made again token-in, and
    the episode checks ``before`` from then on). ``after`` pays only where replies seldom
    re-tokenise differently: the CPU bench's random model drifts on every continuation."""
    sessions: bool = False
    """Serve external agent sessions (``POST /sessions``, ``producers.sessions``): episodes
    opened by agents outside rollq's workers, kept in the run's Redis, published onto its
    traj stream when closed."""
    session_ttl_s: float = Field(default=900.0, gt=0)
    """A session group with no call and no close for this long is dead-lettered
    ``session_expired``."""
    max_staleness: int = Field(default=1, ge=0)
    """Sessions' admission: how many policy versions a group may lag the trainer (the
    feeder's setting of the same name)."""
    batch_groups: int = Field(default=8, ge=1)
    """Sessions' admission: groups the trainer consumes per optimizer step."""
    retry_after_s: int = Field(default=5, ge=1)
    """``Retry-After`` of a session open refused for want of an admission slot (429)."""
