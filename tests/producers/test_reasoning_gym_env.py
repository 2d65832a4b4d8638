"""The ``reasoning_gym:TASK[+TASK...]`` env kind, with the real reasoning-gym package.

The acceptance run: ``rollq feed``, ``rollq workers --env reasoning_gym:...`` and ``rollq
score`` with the ``reasoning_gym`` component (the CLI itself, in threads) on a real
redis-server, the fake vLLM on a loopback port answering right for one completion of each
group and wrong for the other, to the trainer SDK.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient
from rollq.ops.cli import Exit, main
from rollq.producers.envs import make_env
from rollq.producers.envs.reasoning_gym import ReasoningGymEnv
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ConfigError
from rollq.schemas.tagged import decode_tagged
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not "
                                    "installed")

RUN = "rgkind"
SPEC = "reasoning_gym:basic_arithmetic+leg_counting"
INSTRUCTION = "{question}\nGive only the answer, in <answer></answer> tags."


async def version() -> int:
    return 3


async def test_the_dataset_is_built_once_and_items_prompt_with_their_question(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = reasoning_gym.create_dataset

    def counted(name: str, **config: Any) -> Any:
        built.append(name)
        return real(name, **config)

    monkeypatch.setattr(reasoning_gym, "create_dataset", counted)
    env = make_env(SPEC, size=6, seed=2, weights={"leg_counting": 3.0},
                   config={"basic_arithmetic": {"min_terms": 2, "max_terms": 2}},
                   template=INSTRUCTION, system_prompt="direct")
    assert isinstance(env, ReasoningGymEnv) and len(env) == 6 and env.name == SPEC
    fake = FakeVLLM(max_model_len=4096)
    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as pool:
        rollouts = [await env.rollout(env.item(i), pool, group_size=2,
                                      sampling=SamplingParams(max_tokens=8),
                                      policy_version=version) for i in range(6)]
    assert built == ["composite"]  # once per worker, never per item (the composite builds
    # its tasks through the factory it imported, not this attribute)
    expected = real("composite", size=6, seed=2, datasets=[
        reasoning_gym.composite.DatasetSpec("basic_arithmetic", 1.0,
                                            {"min_terms": 2, "max_terms": 2}),
        reasoning_gym.composite.DatasetSpec("leg_counting", 3.0, {})])
    tasks = set()
    for index, rollout in enumerate(rollouts):
        entry = expected[index]
        system, user = rollout.prompt_messages or []
        assert system["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["direct"]
        assert user["content"] == INSTRUCTION.format(question=entry["question"])
        meta = rollout.metadata
        assert decode_tagged(meta["reasoning_gym"]["entry"]) == entry
        assert meta["reasoning_gym"]["dataset"] == "composite"
        assert meta["answer"] == entry["answer"] and meta["index"] == index
        assert meta["task"] == entry["metadata"]["source_dataset"]
        assert [c.policy_version for c in rollout.completions] == [3, 3]
        tasks.add(meta["task"])
    assert tasks == {"basic_arithmetic", "leg_counting"}
    single = make_env("reasoning_gym:leg_counting", size=3, min_animals=2, max_animals=2)
    assert single.config == {"size": 3, "seed": 0, "min_animals": 2, "max_animals": 2}  # type: ignore[attr-defined]


def test_bad_tasks_and_options_stop_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="did you mean basic_arithmetic"):
        make_env("reasoning_gym:basic_arithmetics")
    with pytest.raises(ConfigError, match="config option, keyed by task"):
        make_env(SPEC, min_terms=2)
    with pytest.raises(ConfigError, match="not among the env's tasks"):
        make_env(SPEC, weights={"chain_sum": 2})
    with pytest.raises(ConfigError, match="refused the configuration"):
        make_env("reasoning_gym:basic_arithmetic", no_such_field=1)
    with pytest.raises(ConfigError, match="twice"):
        make_env("reasoning_gym:leg_counting+leg_counting")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an absent package does
    with pytest.raises(ConfigError, match=re.escape("pip install 'rollq[reasoning-gym]'")):
        make_env(SPEC)


@pytest.mark.slow
async def test_rollq_workers_runs_reasoning_gym_tasks_scored_by_their_own_scorers(
        redis_server: RedisServer, real_redis: aioredis.Redis, tmp_path: Path) -> None:
    options = ["--env-option", "size=4", "--env-option", "seed=3",
               "--env-option", f"template={INSTRUCTION}"]
    dataset = make_env(SPEC, size=4, seed=3).dataset  # type: ignore[attr-defined]
    answers = {dataset[i]["question"].strip(): dataset[i]["answer"] for i in range(4)}

    def answer(prompt: str, index: int) -> str:
        [question] = [q for q in answers if q in prompt]
        return f"<answer>{answers[question] if index == 0 else '-999'}</answer>"

    fake = FakeVLLM(max_model_len=4096)
    fake.responder = answer
    reward = tmp_path / "reward.yaml"
    reward.write_text("components: [{name: task, component: reasoning_gym}]\n")
    common = ["--redis-url", redis_server.url, "--run", RUN]
    environ = {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_LOG_LEVEL": "warning"}
    async with serve_fake(fake) as url:
        assert await asyncio.to_thread(main, ["feed", *common, "--env", SPEC, *options],
                                       environ) == Exit.OK
        assert await asyncio.to_thread(main, [
            "workers", *common, "--env", SPEC, *options, "--inference", url,
            "--group-size", "2", "--max-tokens", "40", "--burst"], environ) == Exit.OK
    assert await asyncio.to_thread(main, ["score", *common, "--reward-config", str(reward),
                                          "--processes", "1", "--burst"], environ) == Exit.OK
    async with TrainerClient(real_redis, run=RUN, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=4, timeout_s=20)
        await batch.ack()
    assert sorted(scored.trajectory.metadata["index"] for scored in batch.groups) == [0, 1, 2, 3]
    for scored in batch.groups:
        assert scored.trajectory.env == SPEC
        assert [s.components["task"] for s in scored.scores] == [1.0, 0.0]
        assert [s.reward for s in scored.scores] == [1.0, 0.0]
