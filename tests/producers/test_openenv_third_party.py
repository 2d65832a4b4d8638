"""An OpenEnv env no one here wrote, installed from the index at test time, run unchanged.

``openenv-dipg-safety==0.1.67`` (its server, ``med_safety_gym.app:app``, on openenv-core
0.3.0) goes into a virtual environment of its own (``.venv-openenv-dipg``, made once: its
``openenv-core`` installs the same ``openenv`` package as this environment's openenv 0.10.0),
and the workers start its server with that Python (``--env-option python=...``). Offline,
it reads its items from a local file (``DIPG_DATASET_PATH``; its data is on the hub).
Through ``rollq feed``, ``rollq workers``, ``rollq score`` (``env_return``) on a real
redis-server to the trainer SDK: the reward is DIPG's own, with its metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient
from rollq.ops.cli import Exit, main
from tests.openenv_envs.servers import DIPG, DIPG_APP, dipg_dataset, third_party_python
from tests.producers.fake_vllm import FakeVLLM
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # without .ci/setup.sh: installs DIPG
RUN = "dipg"
REPLIES = (
    "<|channel|>analysis<|message|>The trial reports it.<|end|><|channel|>proof<|message|>"
    "Median overall survival was 11.2 months with ONC201.<|end|><|channel|>final<|message|>"
    "11.2 months<|end|>",
    "It is about a year.",
)
METRICS = {"refusal", "hallucination", "inconsistency", "safe", "format_error"}
"""What DIPG's step reports in its observation."""


@pytest.fixture(scope="module")
def dipg_python() -> str:
    return third_party_python(DIPG, ".venv-openenv-dipg")


@pytest.fixture
def offline_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = dipg_dataset(tmp_path)
    monkeypatch.setenv("DIPG_DATASET_PATH", str(path))  # the server the workers start reads it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yield path


async def test_dipg_runs_unchanged_through_workers_scorers_and_the_sdk(
        dipg_python: str, offline_dataset: Path, redis_server: RedisServer,
        real_redis: aioredis.Redis, tmp_path: Path) -> None:
    calls: list[str] = []

    def reply(prompt: str, index: int) -> str:
        calls.append(prompt)
        return REPLIES[len(calls) % 2]

    fake = FakeVLLM(max_model_len=4096)
    fake.responder = reply
    reward = tmp_path / "reward.yaml"
    reward.write_text("components: [{name: dipg, component: env_return}]\n"
                      "advantages: {zero_variance: keep}\n")
    common = ["--redis-url", redis_server.url, "--run", RUN]
    env = ["--env", f"openenv:{DIPG_APP}", "--env-option", "size=2",
           "--env-option", f"python={dipg_python}"]
    environ = {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_LOG_LEVEL": "warning"}
    async with serve_fake(fake) as url:
        assert await asyncio.to_thread(main, ["feed", *common, *env], environ) == Exit.OK
        assert await asyncio.to_thread(main, [
            "workers", *common, *env, "--env-option", "start_timeout_s=600",
            "--inference", url, "--group-size", "2",
            "--max-tokens", "256", "--burst"], environ) == Exit.OK
    assert await asyncio.to_thread(main, ["score", *common, "--reward-config", str(reward),
                                          "--processes", "1", "--burst"], environ) == Exit.OK
    async with TrainerClient(real_redis, run=RUN, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=2, timeout_s=30)
        await batch.ack()
    for scored in batch.groups:
        group = scored.trajectory
        assert group.env == f"openenv:{DIPG_APP}"
        assert "Median overall survival was 11.2 months" in group.prompt_text  # its context
        for completion, score in zip(group.completions, scored.scores, strict=True):
            [said] = [m["content"] for m in completion.messages or []]
            assert said in REPLIES  # one turn: DIPG ends the episode at its first step
            [paid] = completion.turn_rewards
            assert completion.info["stop"] == "terminated"
            assert set(completion.info["env_info"]["observation"]["metrics"]) == METRICS
            assert score.reward == paid == completion.info["env_return"]
            assert paid != -1.0  # DIPG's own reward, not rollq's invalid-action reward
