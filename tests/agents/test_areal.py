"""AReaL's shapes, written from its public API as minimal classes, through real workers:
arealite's Agent (aact/areset) + gymnasium Environment + RolloutCollector.arun_episode, and
the current workflow (``async run(data, base_url=, http_client=, api_key=)``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from rollq.producers.envs.areal import ArealCollectorEnv, ArealGenerationConfig, areal_workflow_env
from tests.agents.agents import QUESTIONS, CalculatorWorkflow
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import served, tool_script, trainable_runs
from tests.agents.pipeline import run_workers, score_and_train
from tests.producers.fake_vllm import encode_text
from tests.redis_server import RedisServer

# --- arealite.api.io_struct / rollout_api, minimal ----------------------------------------


@dataclass
class LLMRequest:
    rid: str = field(default_factory=lambda: str(uuid.uuid4()))
    text: str | None = None
    input_ids: list[int] = field(default_factory=list)
    gconfig: ArealGenerationConfig = field(default_factory=ArealGenerationConfig)


@dataclass
class AgentInferInput:
    obs: Any
    gconfig: ArealGenerationConfig


@dataclass
class AgentInferOutput:
    action: Any
    llm_req: LLMRequest
    llm_resp: Any


@dataclass
class TrajStats:
    start_time: float = 0.0
    total_reward: float = 0.0
    episode_length: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    prompt: dict[str, Any]
    data: dict[str, Any]
    stats: TrajStats


class SumAgent:
    """An arealite ``Agent``: keeps its own token history (token-in), one turn per obs."""

    def __init__(self, llm_client: Any) -> None:
        self.llm_client = llm_client
        self.history: list[int] = []

    async def areset(self) -> None:
        self.history = []

    async def aact(self, inp: AgentInferInput) -> AgentInferOutput:
        self.history += encode_text(f"{inp.obs}\nA:")  # the agent's tokenizer
        request = LLMRequest(input_ids=list(self.history), gconfig=inp.gconfig)
        response = await self.llm_client.agenerate(request)
        self.history += response.output_tokens
        return AgentInferOutput(action=response.completion, llm_req=request, llm_resp=response)


class SumEnvironment:
    """A gymnasium-style ``Environment``: answer a sum, hinted after a wrong answer."""

    def __init__(self) -> None:
        self.target = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.target = sum((options or {})["terms"])
        return f"Q: {' + '.join(map(str, (options or {})['terms']))} = ?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        right = str(self.target) in action
        return ("" if right else "Wrong, try again."), float(right), right, False, {}


class SumCollector:
    """An arealite ``RolloutCollector``: agent and env; ``arun_episode`` drives them."""

    def __init__(self, agent_factory: Any, env: SumEnvironment, max_turns: int = 3) -> None:
        self.agent_factory, self.env, self.max_turns = agent_factory, env, max_turns

    async def arun_episode(self, llm_client: Any, gconfig: ArealGenerationConfig,
                           env_option: Any = None, seed: int | None = None) -> Trajectory:
        agent = self.agent_factory(llm_client)
        await agent.areset()
        obs, _ = self.env.reset(seed=seed, options=env_option)
        stats = TrajStats()
        for _ in range(self.max_turns):
            out = await agent.aact(AgentInferInput(obs=obs, gconfig=gconfig))
            obs, reward, terminated, truncated, _ = self.env.step(out.action)
            stats.total_reward += float(reward)
            stats.episode_length += 1
            if terminated or truncated:
                break
        return Trajectory(prompt={}, data={}, stats=stats)


RECORDS = [{"terms": [2, 3]}, {"terms": [4, 4]}]


async def test_arealite_agent_env_and_collector_run_through_real_workers(
        redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    fake = AgentFakeVLLM()
    fake.script = lambda prompt, n: " 5" if "Wrong" in prompt else " 7"  # right on turn 2 of [2, 3]
    env = ArealCollectorEnv("areal-sums", lambda: SumCollector(SumAgent, SumEnvironment()),
                            RECORDS)
    groups = await run_workers(redis_server.url, real_redis, env, fake, [0, 1])
    by_item = {group.metadata["terms"][0]: group for group in groups}
    first = by_item[2]
    assert [c.info["env_score"] for c in first.completions] == [1.0, 1.0]
    assert [c.info["calls"] for c in first.completions] == [[0, 1], [0, 1]]  # token-in merged
    assert [c.info["episode_metadata"]["episode_length"] for c in first.completions] == [2, 2]
    assert [c.info["env_score"] for c in by_item[4].completions] == [0.0, 0.0]
    runs = sorted(run for g in groups for c in g.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in fake.replies)
    batch = await score_and_train(real_redis, groups)
    assert sorted(s.reward for g in batch.groups for s in g.scores) == [0.0, 0.0, 1.0, 1.0]


async def test_areal_workflow_runs_on_a_gateway_url_per_episode_through_real_workers(
        redis_server: RedisServer, real_redis: aioredis.Redis) -> None:
    fake = AgentFakeVLLM()
    fake.script = tool_script(compact=True)
    records = [{"question": question} for question in QUESTIONS]
    env = areal_workflow_env("areal-calc", CalculatorWorkflow(), records)
    [group] = await run_workers(redis_server.url, real_redis, env, fake, [0])
    assert [c.info["env_score"] for c in group.completions] == [1.0, 1.0]
    assert all(c.info["capture"]["text_drift"] == 2 for c in group.completions)
    runs = sorted(run for c in group.completions for run in trainable_runs(c))
    assert runs == sorted(served(reply) for reply in fake.replies)
