"""A gem game on the real CPU vLLM, no user code: ``rollq feed``, ``rollq workers --env
gem:...`` with vLLM structured outputs (``--sampling-option``) so the tiny random model
plays in gem's ``\\boxed{N}`` format, ``rollq score`` with ``env_return``, and the trainer
SDK. The game's rewards are replayed through gem from the replies the model sent."""

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
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
gem = pytest.importorskip("gem", reason="the gem extra (gem-llm) is not installed")

GAME = "game:GuessTheNumber-v0-easy"
RUN = "gem-vllm"
GUESS = r"\\boxed\{[1-9]\}"


async def test_a_gem_game_on_real_vllm_scored_on_its_return(
        vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
        tmp_path: Path) -> None:
    reward = tmp_path / "reward.yaml"
    reward.write_text("components: [{name: game, component: env_return}]\n"
                      "advantages: {zero_variance: keep}\n")
    common = ["--redis-url", redis_server.url, "--run", RUN]
    env = ["--env", f"gem:{GAME}", "--env-option", "size=2",
           "--env-option", "max_completion_tokens=300"]
    environ = {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_LOG_LEVEL": "warning"}
    assert await asyncio.to_thread(main, ["feed", *common, *env], environ) == Exit.OK
    assert await asyncio.to_thread(main, [
        "workers", *common, *env, "--inference", vllm_server.url, "--group-size", "3",
        "--max-tokens", "24", "--concurrency", "2",
        "--sampling-option", "structured_outputs=" + json.dumps({"regex": GUESS}),
        "--burst"], environ) == Exit.OK
    assert await asyncio.to_thread(main, ["score", *common, "--reward-config", str(reward),
                                          "--processes", "1", "--burst"], environ) == Exit.OK
    async with TrainerClient(real_redis, run=RUN, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=2, timeout_s=30)
        await batch.ack()
    turns = 0
    for scored in batch.groups:
        group = scored.trajectory
        for completion, score in zip(group.completions, scored.scores, strict=True):
            replies = [m["content"] for m in completion.messages if m["role"] == "assistant"]
            assert all(re.fullmatch(GUESS, reply) for reply in replies), replies
            game = gem.make(GAME)
            game.reset(seed=group.metadata["seed"])
            rewards = [float(game.step(reply)[1]) for reply in replies]
            assert completion.turn_rewards == rewards
            assert score.reward == pytest.approx(sum(rewards)) == completion.info["env_return"]
            logprobs = np.asarray(completion.logprobs)
            mask = np.asarray(completion.loss_mask)
            assert np.all(logprobs[mask == 1] <= 0) and np.all(logprobs[mask == 0] == 0)
            turns += len(replies)
    assert turns > len(batch.groups) * 3  # some episodes went on after a wrong guess
