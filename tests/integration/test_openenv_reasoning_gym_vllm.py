"""reasoning-gym tasks and OpenEnv envs on the real CPU vLLM, no user code.

The tiny model solves nothing; vLLM's structured outputs (``--sampling-option``) keep its
replies in each env's format, so the tests prove the path: the prompts, the exact capture
(the server's token ids and logprobs, env tokens masked), and scoring by the envs' own
scorers (``reasoning_gym``: the task's ``score_answer``; ``env_return``: the OpenEnv env's
rewards). The OpenEnv envs' servers are started by the workers: the guessing game written
as OpenEnv's docs write one, and DIPG (``openenv-dipg-safety``, installed from the index).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient
from rollq.ops.cli import Exit, main
from rollq.ops.local.stack import VllmProcess
from rollq.producers.envs import make_env
from rollq.schemas import ScoredGroup
from rollq.schemas.tagged import decode_tagged
from tests.openenv_envs.servers import (
    DIPG,
    DIPG_APP,
    GUESS_APP,
    dipg_dataset,
    third_party_python,
)
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
ENVIRON = {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_LOG_LEVEL": "warning"}


async def run(redis_url: str, run: str, env: list[str], reward: str, vllm_url: str,
              worker_flags: list[str], real_redis: aioredis.Redis, groups: int,
              tmp_path: Path) -> list[ScoredGroup]:
    """``rollq feed``, ``rollq workers``, ``rollq score``; the scored groups the SDK reads."""
    config = tmp_path / f"{run}.yaml"
    config.write_text(reward)
    common = ["--redis-url", redis_url, "--run", run]
    assert await asyncio.to_thread(main, ["feed", *common, *env], ENVIRON) == Exit.OK
    assert await asyncio.to_thread(main, ["workers", *common, *env, "--inference", vllm_url,
                                          "--concurrency", "2", *worker_flags, "--burst"],
                                   ENVIRON) == Exit.OK
    assert await asyncio.to_thread(main, ["score", *common, "--reward-config", str(config),
                                          "--processes", "1", "--burst"], ENVIRON) == Exit.OK
    async with TrainerClient(real_redis, run=run, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=groups, timeout_s=60)
        await batch.ack()
    return list(batch.groups)


def assert_captured(logprobs: list[float], mask: list[int]) -> None:
    values, trainable = np.asarray(logprobs), np.asarray(mask) == 1
    assert trainable[0] and np.all(values[trainable] <= 0) and np.all(values[~trainable] == 0)


async def test_reasoning_gym_tasks_on_real_vllm_scored_by_their_scorers(
        vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
        tmp_path: Path) -> None:
    spec = "reasoning_gym:basic_arithmetic+leg_counting"
    env = ["--env", spec, "--env-option", "size=2", "--env-option", "seed=4",
           "--env-option", "template={question} Answer in <answer></answer> tags."]
    answer = r"<answer>-?[0-9]{1,3}</answer>"
    scored = await run(redis_server.url, "rg-vllm", env,
                       "components: [{name: task, component: reasoning_gym}]\n"
                       "advantages: {zero_variance: keep}\n", vllm_server.url,
                       ["--group-size", "3", "--max-tokens", "40", "--sampling-option",
                        "structured_outputs=" + json.dumps({"regex": answer})],
                       real_redis, 2, tmp_path)
    dataset = make_env(spec, size=2, seed=4).dataset  # type: ignore[attr-defined]
    for view in scored:
        group = view.trajectory
        entry = decode_tagged(group.metadata["reasoning_gym"]["entry"])
        assert entry == dataset[group.metadata["index"]]
        assert entry["question"] in (group.prompt_text or "")
        for completion, score in zip(group.completions, view.scores, strict=True):
            assert re.fullmatch(answer, completion.text)
            said = completion.text.removeprefix("<answer>").removesuffix("</answer>")
            assert score.components["task"] == dataset.score_answer(said, entry)
            assert_captured(completion.logprobs, completion.loss_mask)


async def test_openenv_envs_on_real_vllm_scored_on_their_rewards(
        vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.openenv_envs.guess_env.models import GuessAction
    from tests.openenv_envs.guess_env.server.guess_environment import GuessEnvironment

    reward = ("components: [{name: env, component: env_return}]\n"
              "advantages: {zero_variance: keep}\n")
    guess = ["--env", f"openenv:{GUESS_APP}", "--env-option", "size=2"]
    scored = await run(redis_server.url, "guess-vllm", guess, reward, vllm_server.url,
                       ["--group-size", "2", "--max-tokens", "4", "--sampling-option",
                        "structured_outputs=" + json.dumps({"regex": "[1-9]"})],
                       real_redis, 2, tmp_path)
    for view in scored:
        for completion, score in zip(view.trajectory.completions, view.scores, strict=True):
            replies = [m["content"] for m in completion.messages or []
                       if m["role"] == "assistant"]
            game = GuessEnvironment()
            game.reset(seed=view.trajectory.metadata["seed"])
            rewards = []
            for reply in replies:
                observation = game.step(GuessAction(guess=reply))
                rewards.append(float(observation.reward or 0.0))
            assert completion.turn_rewards == rewards and completion.info["stop"] == "terminated"
            assert score.reward == pytest.approx(sum(rewards))
            assert_captured(completion.logprobs, completion.loss_mask)
            assert (0 in completion.loss_mask) == (len(replies) > 1)  # hints masked
    monkeypatch.setenv("DIPG_DATASET_PATH", str(dipg_dataset(tmp_path)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    python = await asyncio.to_thread(third_party_python, DIPG, ".venv-openenv-dipg")
    dipg = ["--env", f"openenv:{DIPG_APP}", "--env-option", "size=1",
            "--env-option", f"python={python}"]
    scored = await run(redis_server.url, "dipg-vllm", dipg, reward, vllm_server.url,
                       ["--group-size", "2", "--max-tokens", "16",
                        "--env-option", "start_timeout_s=300", "--sampling-option",
                        "structured_outputs=" + json.dumps({"regex": "[a-z]{4}"})],
                       real_redis, 1, tmp_path)
    [view] = scored
    assert "Median overall survival" in (view.trajectory.prompt_text or "")
    for completion, score in zip(view.trajectory.completions, view.scores, strict=True):
        [paid] = completion.turn_rewards
        assert "metrics" in completion.info["env_info"]["observation"]  # DIPG's own step
        assert score.reward == paid
        assert_captured(completion.logprobs, completion.loss_mask)
