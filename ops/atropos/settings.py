"""Settings of ``rollq atropos-api``."""

from __future__ import annotations

from pydantic import Field

from ops.atropos.store import RewardSource
from ops.settings import CommonSettings


class AtroposApiSettings(CommonSettings):
    """The Atropos-compatible trajectory API of one run."""

    section: str = Field(default="atropos_api", exclude=True, repr=False)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    rewards: RewardSource = "env"
    """``env``: posted groups go straight to the scored stream, rewarded with the env's
    own scores. ``bridge``: they go to the traj stream and rollq's scorers (``rollq
    score``) reward them with the reward bridge; the env's score is the ``env_score``
    component."""
    consumer_group: str = Field(default="atropos", min_length=1)
    """Consumer group of ``/batch`` on the scored streams (every API process of a run
    shares it)."""
    gzip_level: int = Field(default=1, ge=1, le=9)
    """gzip level of large answers and of each group's ``/batch`` piece, deflated once when
    the group is posted (atroposlib uses 9 per answer; 1 is several times faster)."""
    piece_cache_mb: int = Field(default=512, ge=0)
    """Memory of this process for copies of the pieces it posted or read (a 16x2048-token
    group's piece is ~0.45 MB): a batch of them is joined without reading them back from
    Redis. 0: always read from Redis."""
    dedup_window_s: int = Field(default=600, ge=0)
    """An identical re-post (same env, tokens and scores) within this many seconds is
    answered ``received`` without storing the group again (atroposlib's env re-posts after
    a 5xx or a timeout). 0: off."""
    lock_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for, and hold of, the lock that serialises batch assembly."""
    inference: list[str] = Field(default_factory=list)
    """vLLM base URLs served to Atropos envs under ``/inference`` (atroposlib's ``vllm``
    server type: ``/generate`` with the server's token ids; ``ops.atropos.inference``).
    Empty: no inference routes."""
    model: str = ""
    """Served model name of ``inference``; empty: asked from ``/v1/models``."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one generation of the inference routes."""
