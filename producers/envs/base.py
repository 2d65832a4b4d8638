"""The env protocol the rollout worker calls: dataset items by index, one group per rollout.

The worker (``producers.worker``) asks an env for ``item(index)`` (the feeder keeps the
cursor in Redis, so items are addressed by index), calls ``rollout`` once per job, and
builds the ``TrajectoryGroup`` (group id, run, timestamps) from the returned ``Rollout``.

Policy versions: ``policy_version`` is an async callable returning the trainer's current
version. An env calls it before every generation request (each turn of a multi-turn
episode) and stamps ``Completion.policy_version`` with the version at the start; when a
later turn ran under another version it sets per-token ``token_versions``. The granularity
is one HTTP request: within a request the server does not say which tokens were generated
before a weight reload (vLLM's ``/pause?mode=keep`` freezes and resumes a request across
one), so every token of a request carries the version read just before sending it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from producers.inference import InferencePool, SamplingParams
from schemas import Completion

PolicyVersion = Callable[[], Awaitable[int]]
"""Returns the policy version (trainer optimizer step) in force now."""


@dataclass(frozen=True)
class Item:
    """One dataset item: its index and its JSON-serialisable fields."""

    index: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class Rollout:
    """What one rollout produced: a prompt and its group of completions.

    ``metadata`` carries what scoring needs. Dataset envs put the gold final answer under
    ``answer`` (what the accuracy reward reads by default) and also under ``gold``, and the
    worked solution under ``solution``; see ``producers.envs.dataset``.
    """

    prompt_ids: list[int]
    """Prompt token ids, shared by every completion (from the server)."""
    completions: list[Completion]
    prompt_text: str = ""
    prompt_messages: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """An environment the rollout worker can run.

    - ``name``: the env's name on the wire (``TrajectoryGroup.env``).
    - ``len(env)``: number of items; the feeder cycles indices modulo it.
    - ``item(index)``: the item at ``index`` (0 <= index < len(env)); deterministic.
    - ``rollout(item, pool, group_size=, sampling=, policy_version=)``: generate one group
      of ``group_size`` completions for the item. Raises ``InferenceUnavailable`` (retry
      the job later) or a ``ContractError`` (the item can never succeed).
    """

    name: str

    def __len__(self) -> int: ...

    def item(self, index: int) -> Item: ...

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout: ...
