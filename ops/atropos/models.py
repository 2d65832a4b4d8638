"""Request and response bodies of the Atropos trajectory API, as atroposlib 0.4.0 defines them.

Field names, types and defaults match ``atroposlib/api/server.py`` one for one (a test
compares them with atroposlib's own models, field by field); rollq does not import
atroposlib at run time. The shapes of responses that atroposlib answers with plain dicts
are written here as models too, so every answer of this API is typed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class TrainerRegistration(BaseModel):
    """``POST /register``: a trainer announces itself and its batch size (atroposlib's
    ``Registration``; renamed here: ``schemas.runs`` has a run record)."""

    wandb_group: str
    wandb_project: str
    batch_size: int
    """Sequences per batch (``/batch`` returns exactly this many, in whole groups)."""
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    """``POST /register-env``: an env in ``serve`` mode announces itself."""

    max_token_length: int
    desired_name: str
    weight: float
    group_size: int
    min_batch_allocation: float | None = None
    """Minimum fraction (0-1) of every batch this env's groups must fill."""


class EnvIdentifier(BaseModel):
    """``/status-env`` and ``/disconnect-env``: which registered env asks."""

    env_id: int


class ScoredData(BaseModel):
    """One group as an env posts it (``POST /scored_data``): N sequences of one prompt.

    ``masks`` are labels: the token id where the token is trained, -100 elsewhere.
    Per-token lists (``advantages``, ``ref_logprobs``, ``inference_logprobs``) are aligned
    with ``tokens``.
    """

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[Any, Any]] | None = None
    group_overrides: dict[Any, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_have_role_and_content(cls, value: Any) -> Any:
        # atroposlib's rule, with its message
        if value is None:
            return None
        for conversation in value:
            for message in conversation:
                if "role" not in message or "content" not in message:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return value


SCORED_DATA_FIELDS: tuple[str, ...] = tuple(ScoredData.model_fields)
"""Every key of a group as ``/batch`` and ``/latest_example`` give it back, in order."""


class Status(BaseModel):
    """``GET /status``."""

    current_step: int
    queue_size: int
    """Groups waiting for a batch."""


class Info(BaseModel):
    """atroposlib's ``Info`` model (declared there, answered by no endpoint)."""

    batch_size: int = -1


class ServerInfo(Info):
    """``GET /info``: the trainer's batch size and token limit, -1 until one registered."""

    max_token_len: int = -1


class EnvStatus(BaseModel):
    """``GET /status-env``: what an env's back-pressure loop reads."""

    model_config = ConfigDict(extra="forbid")

    current_step: int
    queue_size: int
    """Groups (of this env's size) ahead of a new group of this env."""
    unallocated_fraction: float
    self_queue_size: int
    max_group_size: int
    env_weight: float


class EnvRegistered(BaseModel):
    """``POST /register-env`` once a trainer has started."""

    status: str
    env_id: int
    wandb_name: str
    checkpoint_dir: str
    starting_step: int
    checkpoint_interval: int
    num_steps: int
