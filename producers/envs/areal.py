"""AReaL's agent shapes as rollq envs (AReaL itself is not imported).

(a) **arealite**: a ``RolloutCollector`` whose ``arun_episode(llm_client, gconfig,
    env_option=, seed=) -> Trajectory`` drives an ``Agent`` (``aact``/``areset``) against a
    gymnasium ``Environment``. ``ArealCollectorEnv`` builds a fresh collector per episode
    and hands it an ``ArealLLMClient``: its ``agenerate(req)`` takes AReaL's
    ``LLMRequest`` (``input_ids`` — token-in — or ``text``, and ``gconfig``) and returns an
    ``LLMResponse``-shaped ``ArealLLMResponse`` (``input_tokens``, ``output_tokens``,
    ``output_logprobs``, ``output_versions``, ``stop_reason``…), through the capture layer.
    The episode's reward is ``trajectory.stats.total_reward``; rollq keeps the captured
    tokens, not the collector's tensors.
(b) **AReaL's agent workflow** (any object with ``async run(data, base_url=, http_client=,
    api_key=)``): ``areal_workflow_env`` runs it on a gateway base URL per episode
    (``GatewayEpisodeEnv``). Its return: a float reward; None (AReaL: rejected) is no
    reward; a dict of rewards by completion id is kept as metadata (``rewards``), the
    episode's reward being their sum.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollq.producers.envs.base import (
    EpisodeResult,
    EpisodeWorkflow,
    Item,
    PolicyVersion,
    RecordItems,
    Rollout,
)
from rollq.producers.envs.episode import GatewayEpisodeEnv, UpstreamCache, captured_group
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.inference.capture import EpisodeCapture, EpisodeGateway
from rollq.producers.inference.capture.render import LocalTemplate

AREAL_TOP_K_OFF = 100_000_000
"""AReaL's ``top_k`` default (1e8) means no top-k."""


@dataclass
class ArealGenerationConfig:
    """AReaL's ``GenerationHyperparameters`` fields that reach the server."""

    n_samples: int = 1
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = AREAL_TOP_K_OFF
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | None = None

    @classmethod
    def from_sampling(cls, sampling: SamplingParams) -> ArealGenerationConfig:
        return cls(max_new_tokens=sampling.max_tokens or 256, temperature=sampling.temperature,
                   top_p=sampling.top_p, top_k=sampling.top_k or AREAL_TOP_K_OFF,
                   stop=list(sampling.stop) or None)


@dataclass
class ArealLLMResponse:
    """AReaL's ``LLMResponse`` fields, filled from the server's reply."""

    completion: str
    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: str = "stop"
    """``stop`` or ``length`` (AReaL's names)."""
    latency: float = float("inf")
    ttft: float = float("inf")
    itl: list[float] = field(default_factory=list)


class ArealLLMClient:
    """AReaL's ``LLMClient.agenerate`` over one episode's capture (module docstring)."""

    def __init__(self, capture: EpisodeCapture) -> None:
        self.capture = capture

    async def agenerate(self, req: Any) -> ArealLLMResponse:
        gconfig = getattr(req, "gconfig", None) or ArealGenerationConfig()
        if getattr(gconfig, "n_samples", 1) != 1:
            raise ValueError("one episode generates one sample per call (n_samples=1); a "
                             "group's samples are separate episodes")
        body: dict[str, Any] = {
            "prompt": list(req.input_ids) if getattr(req, "input_ids", None) else req.text,
            "max_tokens": gconfig.max_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": gconfig.top_p, "return_token_ids": True, "logprobs": 0,
        }
        if 0 < gconfig.top_k < AREAL_TOP_K_OFF:
            body["top_k"] = gconfig.top_k
        if gconfig.min_new_tokens:
            body["min_tokens"] = gconfig.min_new_tokens
        if gconfig.stop_token_ids:
            body["stop_token_ids"] = list(gconfig.stop_token_ids)
        if gconfig.stop:
            body["stop"] = list(gconfig.stop)
        started = time.monotonic()
        reply = await self.capture.complete(body)
        choice = reply["choices"][0]
        version = self.capture.calls[-1].policy_version if self.capture.calls else 0
        output = list(choice["token_ids"])
        return ArealLLMResponse(
            completion=str(choice.get("text") or ""), input_tokens=list(choice["prompt_token_ids"]),
            output_tokens=output, output_logprobs=list(choice["logprobs"]["token_logprobs"]),
            output_versions=[version] * len(output),
            stop_reason="length" if choice.get("finish_reason") == "length" else "stop",
            latency=time.monotonic() - started)


@dataclass
class ArealCollectorEnv(RecordItems):
    """An ``Env`` of arealite collectors over a dataset (module docstring).

    - ``make_collector``: a fresh ``RolloutCollector`` (with its agent and env) per episode.
    - ``records``: item ``i`` is ``records[i]``, passed as ``env_option``; every episode of
      a group gets ``seed=i`` (the same task; samples differ by sampling).
    - ``gconfig``: AReaL's generation config from the worker's sampling.
    """

    name: str
    make_collector: Callable[[], Any]
    records: Sequence[dict[str, Any]]
    gconfig: Callable[[SamplingParams], Any] = ArealGenerationConfig.from_sampling
    _upstreams: UpstreamCache = field(default_factory=UpstreamCache, init=False, repr=False)

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        async def play(capture: EpisodeCapture, params: SamplingParams) -> EpisodeResult:
            trajectory = await self.make_collector().arun_episode(
                ArealLLMClient(capture), self.gconfig(params),
                env_option=dict(item.fields), seed=item.index)
            stats = getattr(trajectory, "stats", None)
            reward = getattr(stats, "total_reward", None)
            metadata = {"episode_length": int(getattr(stats, "episode_length", 0) or 0)}
            return EpisodeResult(None if reward is None else float(reward), metadata)

        return await captured_group(self._upstreams(pool), item, play, group_size=group_size,
                                    sampling=sampling, policy_version=policy_version)


class _ArealWorkflowResult:
    """An AReaL workflow whose return value is read AReaL's way (module docstring)."""

    def __init__(self, workflow: EpisodeWorkflow) -> None:
        self.workflow = workflow

    async def run(self, data: dict[str, Any], *, base_url: str, http_client: Any,
                  api_key: str) -> EpisodeResult:
        value = await self.workflow.run(data, base_url=base_url, http_client=http_client,
                                        api_key=api_key)
        if isinstance(value, dict):
            rewards = {str(key): float(reward) for key, reward in value.items()}
            return EpisodeResult(sum(rewards.values()), {"rewards": rewards})
        if value is None:
            return EpisodeResult()
        return EpisodeResult(float(value))


def areal_workflow_env(name: str, workflow: EpisodeWorkflow, records: Sequence[dict[str, Any]],
                       *, gateway: EpisodeGateway | None = None,
                       template: LocalTemplate | None = None) -> GatewayEpisodeEnv:
    """An ``Env`` of an AReaL agent workflow over ``records`` (module docstring);
    ``template``: see ``GatewayEpisodeEnv``."""
    return GatewayEpisodeEnv(name, _ArealWorkflowResult(workflow), records, gateway=gateway,
                             template=template)
