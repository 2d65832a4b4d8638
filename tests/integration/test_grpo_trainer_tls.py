"""``examples/grpo_trainer.py`` against a TLS-only redis-server with a private CA, the CA
given by its ``--redis-ca-file`` flag and, in a second run, by ``ROLLQ_REDIS_CA_FILE``
(issue 34: the example took only ``--redis-url`` and failed CERTIFICATE_VERIFY_FAILED).
No vLLM: with no ``--inference`` the weight sync only bumps the policy version."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.schemas import Completion, TrajectoryGroup
from tests.factories import score
from tests.redis_tls import TlsRedis
from tests.trainer.helpers import RUN, publish_scored

pytest.importorskip("torch", reason="needs the train extra")
pytest.importorskip("transformers", reason="needs the train extra")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent.parent
TRAINER = ROOT / "examples" / "grpo_trainer.py"


async def publish(tls: TlsRedis, groups: int) -> None:
    """Groups of 2 completions whose token ids fit the tiny model's vocabulary."""
    redis = aioredis.Redis.from_url(tls.url(), ssl_ca_certs=str(tls.ca))
    await redis.flushall()
    rng = np.random.default_rng(0)
    for g in range(groups):
        completions = tuple(Completion(
            completion_ids=rng.integers(0, 700, 6, dtype=np.int32),
            logprobs=-rng.random(6, dtype=np.float32), loss_mask=np.ones(6, np.uint8),
            policy_version=0, finish_reason="stop", text="x") for _ in range(2))
        await publish_scored(redis, score(TrajectoryGroup(
            group_id=f"g{g}", run=RUN, env="toy", policy_version=0, prompt_ids=rng.integers(
                0, 700, 5, dtype=np.int32), prompt_text="q", completions=completions)))
    await redis.aclose()


@pytest.mark.parametrize("how", ["flag", "variable"])
async def test_the_example_trainer_over_tls(tls_redis: TlsRedis, tiny_model: Path,
                                            tmp_path: Path, how: str) -> None:
    await publish(tls_redis, 4)
    out = tmp_path / "out"
    argv = [sys.executable, str(TRAINER), "--model", str(tiny_model), "--out", str(out),
            "--redis-url", tls_redis.url(), "--run", RUN, "--steps", "2",
            "--batch-groups", "2", "--max-staleness", "100", "--torch-threads", "1",
            "--metrics", str(out / "metrics.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ROLLQ_REDIS_CA_FILE", None)
    if how == "flag":
        argv += ["--redis-ca-file", str(tls_redis.ca)]
    else:
        env["ROLLQ_REDIS_CA_FILE"] = str(tls_redis.ca)
    done = await asyncio.to_thread(subprocess.run, argv, cwd=ROOT, env=env,
                                   capture_output=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr).decode(errors="replace")[-4000:]
    steps = [json.loads(line)["step"] for line in
             (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
