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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.inference.capture import EpisodeClient
from rollq.schemas import Completion

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

    An env that holds a process or connections of its own (a server it started) may also
    have ``async aclose()``: the worker calls it when it stops (``close_env``).
    """

    name: str

    def __len__(self) -> int: ...

    def item(self, index: int) -> Item: ...

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout: ...


async def close_env(env: object) -> None:
    """Release what ``env`` holds: its ``aclose()``, where it has one."""
    closer = getattr(env, "aclose", None)
    if callable(closer):
        await closer()


class RecordItems:
    """``len(env)`` and ``item(index)`` of an env over ``records`` (JSON objects): item ``i``
    is a copy of ``records[i]``. The dataset, record-episode, gateway-episode and AReaL
    collector envs all address their items this way."""

    records: Sequence[Mapping[str, Any]]

    def __len__(self) -> int:
        return len(self.records)

    def item(self, index: int) -> Item:
        return Item(index=index, fields=dict(self.records[index]))


@dataclass(frozen=True)
class EpisodeResult:
    """What an agent's episode returns (``AgentEnv.run_episode``; a bare float is the
    reward, None is no reward and no metadata)."""

    reward: float | None = None
    """The episode's own reward (e.g. the env's return); every sequence of the episode
    carries it as ``Completion.info["env_score"]``, the reward bridge's ``env_score``
    component. None: left to the scorer's other components."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts about the episode, kept as ``info["episode_metadata"]``."""


@runtime_checkable
class AgentEnv(Protocol):
    """An env whose episodes call the model themselves (``producers.envs.episode``).

    ``name``, ``len(env)`` and ``item(index)`` as for ``Env``;
    ``run_episode(client, item, *, sampling)`` plays one episode of the item, calling the
    model through ``client`` (an ``EpisodeClient``: ``client.chat.completions.create``,
    ``client.completions.create``), and returns an ``EpisodeResult``, a float reward, or
    None. ``sampling`` holds the worker's settings (with a per-episode seed when one is
    set); they fill every field a call leaves out. A group is ``group_size`` episodes of
    one item run concurrently; every call is captured and becomes one or more sequences
    (``producers.inference.capture``). Raise (or let through) ``InferenceUnavailable``
    to have the job retried; any other exception follows the failure taxonomy.
    ``make_env`` wraps such an env in ``ClientEpisodeEnv``, so workers run it unchanged.
    """

    name: str

    def __len__(self) -> int: ...

    def item(self, index: int) -> Item: ...

    async def run_episode(self, client: EpisodeClient, item: Item, *,
                          sampling: SamplingParams) -> EpisodeResult | float | None: ...


@runtime_checkable
class DrawingEnv(Protocol):
    """An env whose items come from a stateful source (Atropos' ``get_next_item``), not by
    index. ``draw()`` returns the next item's JSON-serialisable fields; the rollout runner
    records them per job (``producers.drawn``) and passes them to ``rollout`` as
    ``Item(index=position, fields=...)``, so a re-run of the job rolls the same item.
    ``item(index)`` is still called (and may return a placeholder)."""

    async def draw(self) -> dict[str, Any]: ...


class EpisodeWorkflow(Protocol):
    """An agent that reaches the model through an OpenAI-compatible base URL (AReaL's
    workflow shape): ``run(data, base_url=, http_client=, api_key=)`` with the item's
    fields as ``data``, the episode's own captured URL, and the ``httpx.AsyncClient`` that
    reaches it (None when any client does). Returns like ``run_episode``. Run by
    ``producers.envs.episode.GatewayEpisodeEnv``."""

    async def run(self, data: dict[str, Any], *, base_url: str, http_client: Any,
                  api_key: str) -> Any: ...
