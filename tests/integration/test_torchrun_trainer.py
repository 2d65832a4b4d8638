"""``examples/torchrun_trainer.py`` without vLLM: the same groups trained on 1 rank, on 2
DDP ranks (stopped and resumed from its checkpoint half-way) and on 2 FSDP ranks give the
same loss at every step, with several micro-batches a rank: the split, the gradient
accumulation, the global-token normalisation and the full-state checkpoint are exact."""

from __future__ import annotations

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
from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, publish_scored

torch = pytest.importorskip("torch", reason="needs the train extra")
pytest.importorskip("transformers", reason="needs the train extra")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent.parent
TRAINER = ROOT / "examples" / "torchrun_trainer.py"


async def publish(url: str, groups: int) -> None:
    """Groups of 4 completions of 6-9 tokens whose ids fit the tiny model's vocabulary."""
    redis = aioredis.Redis.from_url(url)
    await redis.flushdb()
    rng = np.random.default_rng(0)
    for g in range(groups):
        completions = tuple(Completion(
            completion_ids=rng.integers(0, 700, 6 + c, dtype=np.int32),
            logprobs=-rng.random(6 + c, dtype=np.float32), loss_mask=np.ones(6 + c, np.uint8),
            policy_version=0, finish_reason="stop", text="x") for c in range(4))
        await publish_scored(redis, score(TrajectoryGroup(
            group_id=f"g{g}", run=RUN, env="toy", policy_version=0, prompt_ids=rng.integers(
                0, 700, 5, dtype=np.int32), prompt_text="q", completions=completions)))
    await redis.aclose()


def train(ranks: int, url: str, model: Path, out: Path, steps: int, *extra: str) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), str(TRAINER), "--model", str(model), "--out", str(out),
            "--redis-url", url, "--run-name", RUN, "--steps", str(steps), "--batch-groups", "4",
            "--micro-batch-tokens", "40", "--max-staleness", "100", "--kl-coef", "0.1",
            "--torch-threads", "1", "--checkpoint-every", "2", "--metrics",
            str(out / "metrics.jsonl"), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr).decode(errors="replace")[-4000:]


def losses(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"], row["kl"]) for row in rows]


async def test_one_rank_ddp_resumed_and_fsdp_agree(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    base = redis_server.url.rsplit("/", 1)[0]
    runs = {"one": (1, ()), "ddp": (2, ()), "fsdp": (2, ("--fsdp",))}
    for db, (name, (ranks, extra)) in enumerate(runs.items(), start=1):
        url = f"{base}/{db}"
        await publish(url, 12)
        out = tmp_path / name
        if name == "ddp":  # two steps, a checkpoint, a new job resumed from it
            train(ranks, url, tiny_model, out, 2, *extra)
            train(ranks, url, tiny_model, out, 3, "--resume", *extra)
        else:
            train(ranks, url, tiny_model, out, 3, *extra)
    one = losses(tmp_path / "one")
    assert [step for step, _, _ in one] == [1, 2, 3]
    for name in ("ddp", "fsdp"):
        np.testing.assert_allclose(losses(tmp_path / name), one, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    metrics = [json.loads(line)
               for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert [m["group_ids"] for m in metrics] == [[f"g{i}" for i in range(s, s + 4)]
                                                 for s in (0, 4, 8)]
