"""``examples/torchrun_trainer.py`` without vLLM: the same groups trained on 1 rank, on 2
DDP ranks (stopped and resumed from its checkpoint half-way) and on 2 FSDP ranks give the
same loss at every step, with several micro-batches a rank: the split, the gradient
accumulation, the global-token normalisation and the full-state checkpoint are exact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.schemas import Completion, TrajectoryGroup
from rollq.schemas.models import SamplingRecord
from tests.factories import score
from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, publish_scored

torch = pytest.importorskip("torch", reason="needs the train extra")
pytest.importorskip("transformers", reason="needs the train extra")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent.parent
TRAINER = ROOT / "examples" / "torchrun_trainer.py"


OFFSET = {0: 0.0, 1: math.log(4), 2: 0.0, 3: math.log(4)}
"""Completion c's sampler logprobs, when recorded: the model's own minus this (a
geometric-mean ratio of 1 or 1/4)."""
SHIFTED = (7 + 9) / (6 + 7 + 8 + 9)
"""The share of trainable tokens in the shifted completions (6 + c tokens each)."""


async def publish(url: str, groups: int, model: Any = None) -> None:
    """Groups of 4 completions of 6-9 tokens whose ids fit the tiny model's vocabulary: their
    sampler logprobs random, their sampling not recorded; or, given ``model``, sampled (as
    the record says) with raw logprobs: the model's own, shifted by ``OFFSET``."""
    redis = aioredis.Redis.from_url(url)
    await redis.flushdb()
    rng = np.random.default_rng(0)
    record = None if model is None else SamplingRecord(temperature=1.0, top_p=1.0,
                                                       logprobs_mode="raw_logprobs")
    for g in range(groups):
        prompt = rng.integers(0, 700, 5, dtype=np.int32)
        completions = []
        for c in range(4):
            ids = rng.integers(0, 700, 6 + c, dtype=np.int32)
            logprobs = (-rng.random(6 + c, dtype=np.float32) if model is None
                        else own_logprobs(model, prompt, ids) - np.float32(OFFSET[c]))
            completions.append(Completion(
                completion_ids=ids, logprobs=logprobs, loss_mask=np.ones(6 + c, np.uint8),
                policy_version=0, finish_reason="stop", text="x", sampling=record))
        await publish_scored(redis, score(TrajectoryGroup(
            group_id=f"g{g}", run=RUN, env="toy", policy_version=0, prompt_ids=prompt,
            prompt_text="q", completions=tuple(completions))))
    await redis.aclose()


def own_logprobs(model: Any, prompt: np.ndarray[Any, Any],
                 ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``model``'s log-probability of each of ``ids`` after ``prompt`` (float32)."""
    sequence = torch.as_tensor(np.concatenate([prompt, ids]), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=sequence[None]).logits[0, len(prompt) - 1:-1]
    chosen = torch.log_softmax(logits.float(), -1).gather(-1, sequence[len(prompt):, None])
    return chosen.squeeze(-1).numpy().astype(np.float32)


def train(ranks: int, url: str, model: Path, out: Path, steps: int, *extra: str,
          fails: bool = False) -> str:
    """The trainer's output; it must exit 0, or, with ``fails``, not."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), str(TRAINER), "--model", str(model), "--out", str(out),
            "--redis-url", url, "--run-name", RUN, "--steps", str(steps), "--batch-groups", "4",
            "--micro-batch-tokens", "40", "--max-staleness", "100", "--kl-coef", "0.1",
            "--torch-threads", "1", "--checkpoint-every", "2", "--metrics",
            str(out / "metrics.jsonl"), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120)
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert (done.returncode != 0) == fails, output[-4000:]
    return output


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



async def test_the_off_policy_correction_weighs_each_packed_sequence_on_every_rank(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    """``--is-correction geo`` under torchrun: micro-batches pack several sequences in a
    row, and each sequence is still kept or dropped by its own geometric-mean ratio (half
    the completions were sampled at 1/4 the model's probability: exactly their tokens are
    dropped, on 1 rank and on 2, whose losses agree). Groups whose sampling was not
    recorded are refused before any step: every rank exits 78 with the reason, the batch
    stays pending."""
    base = redis_server.url.rsplit("/", 1)[0]
    await publish(f"{base}/4", 4)  # no sampling record
    output = train(2, f"{base}/4", tiny_model, tmp_path / "refused", 1,
                   "--is-correction", "geo", fails=True)
    assert output.count("torchrun_trainer: --is-correction geo cannot use this batch: "
                        "sequence 0 (and 15 more of 16): its sampling was not recorded") == 2
    redis = aioredis.Redis.from_url(f"{base}/4")
    assert (await redis.xpending("rollq:{test:0}:scored", "trainer"))["pending"] == 4
    await redis.aclose()
    assert (tmp_path / "refused" / "metrics.jsonl").read_text() == ""  # no step
    assert not (tmp_path / "refused" / "checkpoint.pt").exists()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    geo = ("--is-correction", "geo", "--is-geo-mask", "0.8", "1.25")
    rows = {}
    for db, ranks in ((5, 1), (6, 2)):
        await publish(f"{base}/{db}", 8, model)
        train(ranks, f"{base}/{db}", tiny_model, tmp_path / str(ranks), 2, *geo)
        rows[ranks] = [json.loads(line) for line in
                       (tmp_path / str(ranks) / "metrics.jsonl").read_text().splitlines()]
        assert [row["is_filter_drop_frac"] for row in rows[ranks]] == pytest.approx(
            [SHIFTED] * 2), ranks
    np.testing.assert_allclose([row["loss"] for row in rows[2]],
                               [row["loss"] for row in rows[1]], rtol=1e-4, atol=1e-6)
