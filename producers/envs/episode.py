"""Agents that call the model themselves, as ``Env``s the rollout worker runs unchanged.

- ``ClientEpisodeEnv(env)``: an ``AgentEnv`` whose ``run_episode(client, item, sampling=)``
  gets an ``EpisodeClient``.
- ``GatewayEpisodeEnv(name, workflow, records, gateway=)``: an ``EpisodeWorkflow`` (AReaL's
  ``run(data, base_url=, http_client=, api_key=)``) that talks to an OpenAI-compatible base
  URL of its own: an in-process ``LocalGateway`` on the worker's pool by default, or a
  ``RemoteGateway`` (a ``rollq gateway``) for agents that build their own HTTP client.

A group is ``group_size`` episodes of one item, run concurrently (episode ``j`` samples with
``seed + j`` when the worker's sampling has a seed). Every call is captured
(``producers.inference.capture``); ``build_rollout`` turns the episodes into one group:

- the group's ``prompt_ids`` are the longest common prefix of every sequence's prompt
  (the whole first prompt when all episodes start alike);
- each sequence is one ``Completion``: the rest of its own prompt (masked, logprob 0),
  then its model tokens (mask 1, the server's logprobs) and env tokens (mask 0);
- ``Completion.info`` says where it belongs: ``episode`` (the sample, 0..group_size-1),
  ``sequence`` (its index within the episode, in the order the sequences started),
  ``sequences`` (how many the episode has), ``prompt_tokens`` (how many leading tokens
  are its own masked prompt), ``calls`` (the episode's call indices merged into it),
  ``capture`` (the episode's ``CaptureStats``: ``calls``, ``token_in``, ``text_drift``,
  ``rejected``, ``unavailable``), ``episode_metadata``, and ``env_score`` (the episode's
  reward, when it returned one). A group may thus hold more completions than
  ``group_size``; consumers that need one value per sample group by ``info["episode"]``.

Failures: a call that failed for want of inference fails the job with
``InferenceUnavailable`` (retried), even if the agent caught the error; an episode that
raised after a call was refused (a 4xx from the server, or ``n`` not 1) is a
``ContractError`` (``contract_error``, not retried: the agent's own HTTP client raises its
own error class, e.g. ``openai.BadRequestError``, which would otherwise be an
``unexpected_error``), while an agent that caught the refusal and finished its episode
(ending it on a full context, say) keeps its group; an episode that made no model call is
a ``ContractError``; anything else the episode raises goes to the worker's failure
taxonomy as is.

A job's episodes close with the job: the worker runs each try inside ``job_episodes()``,
which records every episode a ``GatewayEpisodeEnv`` opens for it; when the try runs past its
timeout (or is cancelled), the worker closes the ones still open at once
(``JobEpisodes.close_all``), whether or not the agent gives up its task: a hung agent that
ignores the cancellation no longer holds a gateway episode until ``episode_ttl_s``. A
remote episode's id is chosen before its open is sent, so an open cut short by the timeout
is closed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollq.producers.envs.base import (
    AgentEnv,
    EpisodeResult,
    EpisodeWorkflow,
    Item,
    PolicyVersion,
    RecordItems,
    Rollout,
)
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.inference.capture import (
    CapturedEpisode,
    CaptureHub,
    EpisodeCapture,
    EpisodeClient,
    EpisodeGateway,
    LocalGateway,
    OpenEpisode,
    Upstream,
)
from rollq.producers.inference.capture.render import LocalTemplate
from rollq.schemas import Completion, ContractError, InferenceUnavailable

log = structlog.get_logger("rollq.episodes")


class JobEpisodes:
    """The gateway episodes a rollout job's try has open (module docstring)."""

    def __init__(self) -> None:
        self.open: dict[str, tuple[EpisodeGateway, OpenEpisode]] = {}
        self.closed_early: set[str] = set()
        """Episodes ``close_all`` closed while their agent still ran."""

    async def close_all(self, why: str) -> int:
        """Close every episode still open (best effort: a gateway that is away forgets them
        at ``episode_ttl_s``); how many were open."""
        left = list(self.open.items())
        self.open.clear()
        for episode_id, (gateway, episode) in left:
            self.closed_early.add(episode_id)
            try:
                await gateway.close(episode)
            except Exception as exc:  # the job's own outcome stands
                log.warning("episode_not_closed", episode=episode_id, error=str(exc))
        if left:
            log.info("job_episodes_closed", episodes=len(left), why=why)
        return len(left)


_JOB_EPISODES: contextvars.ContextVar[JobEpisodes | None] = contextvars.ContextVar(
    "rollq_job_episodes", default=None)


@contextlib.contextmanager
def job_episodes() -> Iterator[JobEpisodes]:
    """Record the episodes opened inside the block (its tasks too) for one job's try."""
    episodes = JobEpisodes()
    token = _JOB_EPISODES.set(episodes)
    try:
        yield episodes
    finally:
        _JOB_EPISODES.reset(token)


def as_result(value: Any) -> EpisodeResult:
    """An episode's return value as an ``EpisodeResult`` (a number is the reward)."""
    if value is None:
        return EpisodeResult()
    if isinstance(value, EpisodeResult):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return EpisodeResult(reward=float(value))
    raise ContractError(f"an episode returned a {type(value).__name__}: return an "
                        "EpisodeResult, a float reward or None")


def episode_sampling(sampling: SamplingParams, episode: int) -> SamplingParams:
    """The sampling of episode ``episode`` of a group: its own seed when one is set."""
    if sampling.seed is None:
        return sampling
    return sampling.model_copy(update={"seed": sampling.seed + episode})


EpisodePlay = Callable[[EpisodeCapture, SamplingParams], Awaitable[EpisodeResult]]
"""Plays one episode against its capture, with the episode's sampling."""


async def captured_group(upstream: Upstream, item: Item, play: EpisodePlay, *,
                         group_size: int, sampling: SamplingParams,
                         policy_version: PolicyVersion,
                         tool_parser: str | None = "hermes") -> Rollout:
    """``group_size`` episodes of ``item`` run concurrently, each ``play``ed against its own
    ``EpisodeCapture`` on ``upstream`` (episode ``j`` with ``episode_sampling(sampling, j)``),
    as one group (``build_rollout``). The capture is closed whether the episode ends or
    raises."""
    async def episode(index: int) -> tuple[CapturedEpisode, EpisodeResult]:
        params = episode_sampling(sampling, index)
        capture = EpisodeCapture(upstream, episode_id=str(index), defaults=params.body(),
                                 policy_version=policy_version, tool_parser=tool_parser)
        try:
            result = await play(capture, params)
        except Exception as exc:
            failure = episode_failure(index, capture.close())
            if failure is None:
                raise
            raise failure from exc
        except BaseException:  # cancelled (a sibling episode failed): closed all the same
            capture.close()
            raise
        return capture.close(), result

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(episode(index)) for index in range(group_size)]
    return build_rollout([task.result() for task in tasks], item)


def episode_failure(index: int, captured: CapturedEpisode) -> Exception | None:
    """What an episode that raised fails its job with (module docstring): its model calls'
    failure when one explains it; None to let the episode's own exception through."""
    if captured.unavailable_error is not None:
        return InferenceUnavailable(f"episode {index}: a model call failed: "
                                    f"{captured.unavailable_error}")
    if captured.rejected_error is not None:
        return ContractError(f"episode {index} ended on a refused model call: "
                             f"{captured.rejected_error}")
    return None


class UpstreamCache:
    """One ``Upstream`` per pool (its model name and template probe are learned once);
    ``template`` renders chat continuations in this process (``Upstream``)."""

    def __init__(self, template: LocalTemplate | None = None) -> None:
        self.template = template
        self._by_pool: dict[int, Upstream] = {}

    def __call__(self, pool: InferencePool) -> Upstream:
        upstream = self._by_pool.get(id(pool))
        if upstream is None or upstream.pool is not pool:
            upstream = self._by_pool[id(pool)] = Upstream(pool, template=self.template)
        return upstream


@dataclass
class ClientEpisodeEnv:
    """An ``Env`` of an ``AgentEnv`` (module docstring)."""

    env: AgentEnv
    tool_parser: str | None = "hermes"
    """How token-in chat replies find tool calls (``capture.toolcalls``)."""
    _upstreams: UpstreamCache = field(default_factory=UpstreamCache, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.env.name

    def __len__(self) -> int:
        return len(self.env)

    def item(self, index: int) -> Item:
        return self.env.item(index)

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        async def play(capture: EpisodeCapture, params: SamplingParams) -> EpisodeResult:
            return as_result(await self.env.run_episode(EpisodeClient(capture), item,
                                                        sampling=params))

        return await captured_group(self._upstreams(pool), item, play, group_size=group_size,
                                    sampling=sampling, policy_version=policy_version,
                                    tool_parser=self.tool_parser)


@dataclass
class GatewayEpisodeEnv(RecordItems):
    """An ``Env`` of an ``EpisodeWorkflow`` over a dataset (module docstring).

    - ``records``: the dataset; item ``i`` is ``records[i]`` (a JSON object).
    - ``gateway``: None for a ``LocalGateway`` on the worker's pool (the workflow must use
      the ``http_client`` it is given), or e.g. ``RemoteGateway(url)``.
    - ``api_key``: what the workflow is told to send (a gateway checks none).
    - ``template``: the in-process gateway renders chat continuations with it (the served
      model's tokenizer and the server's chat template, ``LocalTemplate``) instead of two
      ``/tokenize`` requests each, as ``rollq gateway --tokenizer`` does.
    """

    name: str
    workflow: EpisodeWorkflow
    records: Sequence[dict[str, Any]]
    gateway: EpisodeGateway | None = None
    api_key: str = "rollq"
    tool_parser: str | None = "hermes"
    template: LocalTemplate | None = None
    _upstreams: UpstreamCache = field(default_factory=UpstreamCache, init=False, repr=False)
    _local: dict[int, LocalGateway] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._upstreams = UpstreamCache(self.template)

    def _gateway(self, pool: InferencePool) -> EpisodeGateway:
        if self.gateway is not None:
            return self.gateway
        local = self._local.get(id(pool))
        if local is None or local.hub.upstream.pool is not pool:
            hub = CaptureHub(self._upstreams(pool), tool_parser=self.tool_parser)
            local = self._local[id(pool)] = LocalGateway(hub)
        return local

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        gateway = self._gateway(pool)
        stamp = None if isinstance(gateway, LocalGateway) else await policy_version()

        job = _JOB_EPISODES.get()

        async def close(opened: OpenEpisode) -> CapturedEpisode:
            if job is not None:
                if opened.episode_id in job.closed_early:
                    raise TimeoutError(f"episode {opened.episode_id} was closed when its job "
                                       "ran past its timeout")
                job.open.pop(opened.episode_id, None)
            return await gateway.close(opened)

        async def episode(index: int) -> tuple[CapturedEpisode, EpisodeResult]:
            params = episode_sampling(sampling, index)
            opened = await gateway.open(defaults=params.body(), policy_version=policy_version,
                                        opening=None if job is None else job.open)
            try:
                value = await self.workflow.run(dict(item.fields), base_url=opened.base_url,
                                                http_client=opened.http_client,
                                                api_key=self.api_key)
            except Exception as exc:
                failure = episode_failure(index, await close(opened))
                if failure is None:
                    raise
                raise failure from exc
            except BaseException:  # cancelled: the gateway still forgets the episode
                await close(opened)
                raise
            return await close(opened), as_result(value)

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(episode(index)) for index in range(group_size)]
        return build_rollout([task.result() for task in tasks], item, stamp_version=stamp)


def common_prefix_length(sequences: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    low, high = min(sequences), max(sequences)  # lexicographic extremes bound every prefix
    for position, (a, b) in enumerate(zip(low, high, strict=False)):
        if a != b:
            return position
    return min(len(low), len(high))


def build_rollout(episodes: list[tuple[CapturedEpisode, EpisodeResult]], item: Item, *,
                  stamp_version: int | None = None) -> Rollout:
    """One group of the episodes' sequences (module docstring). ``stamp_version`` replaces
    every token's version (captures that could not read it: a remote gateway)."""
    for index, (captured, _result) in enumerate(episodes):
        if captured.unavailable_error is not None:
            raise InferenceUnavailable(f"episode {index}: a model call failed: "
                                       f"{captured.unavailable_error}")
        if not captured.sequences:
            raise ContractError(f"episode {index} made no model call that returned a token")
    prompts = [seq.prompt_ids for captured, _ in episodes for seq in captured.sequences]
    common = common_prefix_length(prompts)
    prompt_ids = prompts[0][:common]
    completions = []
    for index, (captured, result) in enumerate(episodes):
        for number, seq in enumerate(captured.sequences):
            own = seq.prompt_ids[common:]
            versions = ([seq.versions[0]] * len(own) + seq.versions if stamp_version is None
                        else [stamp_version] * (len(own) + len(seq.versions)))
            info: dict[str, Any] = {
                "episode": index, "sequence": number, "sequences": len(captured.sequences),
                "prompt_tokens": len(own), "calls": seq.calls,
                "capture": captured.stats.model_dump(), "episode_metadata": result.metadata,
            }
            if result.reward is not None:
                info["env_score"] = result.reward
            completions.append(Completion(
                completion_ids=[*own, *seq.completion_ids],
                logprobs=[0.0] * len(own) + seq.logprobs,
                loss_mask=[0] * len(own) + seq.loss_mask,
                policy_version=versions[0],
                token_versions=versions if len(set(versions)) > 1 else None,
                finish_reason=seq.finish_reason, text=seq.text, messages=seq.messages,
                info=info))
    return Rollout(prompt_ids=prompt_ids, completions=completions,
                   metadata={**item.fields, "episodes": len(episodes)})
