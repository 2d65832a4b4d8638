"""Off-policy correction data on a real CPU vLLM server (issue 44).

- A sample records how it was sampled, the logprobs mode asked of the server itself
  (``/server_info``: the session's server runs in dev mode).
- The example trainer's correction: on a batch the server sampled from the trainer's own
  weights the ratio is ≈ 1 (raw logprobs, float32 on both sides) and nothing is masked;
  after two optimizer steps (the batch is two versions stale) it is not, the correction
  masks tokens, and the staleness histogram says 2.
- A sync with ``pause_mode='abort'`` that meets a generation midway counts the request it
  aborted (the control of ``keep``'s 0, asserted in test_weight_sync_vllm.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.consumers.trainer.batch import BatchData
from rollq.consumers.trainer.layout import PaddedArrays, pad_groups
from rollq.ops.local.stack import VllmProcess
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.schemas import ScoredGroup, SequenceScore, TrajectoryGroup

torch = pytest.importorskip("torch", reason="needs the train extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_trainer.py"
PROMPTS = ["Alice has 3 apples", "7 + 5 = 12 and 3 + 4 =", "the answer is"]


def example() -> Any:
    """``examples/grpo_trainer.py`` as a module (its ``train_on``, ``parse_args``)."""
    spec = importlib.util.spec_from_file_location("grpo_trainer_offpolicy", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh(vllm_server: VllmProcess, tiny_model: Path) -> VllmProcess:
    """The session's server, serving the tiny model's own weights (other tests sync theirs)."""
    httpx.post(f"{vllm_server.url}/collective_rpc", timeout=120, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(tiny_model)}})
    httpx.post(f"{vllm_server.url}/reset_prefix_cache", timeout=30)
    httpx.post(f"{vllm_server.url}/resume", timeout=30)
    return vllm_server


async def sampled_batch(url: str) -> BatchData:
    """Groups the server samples (temperature 1, top_p 1), scored with ±1 advantages."""
    params = SamplingParams(max_tokens=16, seed=0)
    async with InferencePool([url], health_interval_s=None, logprobs_mode="auto") as pool:
        choices = await asyncio.gather(*(pool.complete(p, n=4, params=params) for p in PROMPTS))
    groups = []
    for index, samples in enumerate(choices):
        group = TrajectoryGroup(group_id=f"g{index}", run="offpolicy", env="toy",
                                policy_version=0, prompt_ids=samples[0].prompt_ids,
                                completions=tuple(s.to_completion(0) for s in samples))
        groups.append(ScoredGroup(trajectory=group, scores=tuple(
            SequenceScore(reward=float(i % 2), advantage=float(i % 2) * 2 - 1,
                          token_advantages=np.full(len(c.completion_ids), i % 2 * 2 - 1.0,
                                                   np.float32))
            for i, c in enumerate(group.completions))))
    padded = pad_groups(groups)
    arrays = {name: getattr(padded, name) for name in PaddedArrays.__dataclass_fields__}
    return BatchData(**arrays, sources=tuple(groups), entries=())


def test_samples_record_the_servers_logprobs_mode_and_the_correction_sees_staleness(
        fresh: VllmProcess, tiny_model: Path) -> None:
    batch = asyncio.run(sampled_batch(fresh.url))
    record = batch.sampling[0]
    assert record is not None and record.logprobs_mode == "raw_logprobs"  # vLLM's default
    assert (record.temperature, record.top_p, record.model) == (1.0, 1.0, "rollq-tiny")

    trainer = example()
    args: argparse.Namespace = trainer.parse_args([
        "--model", str(tiny_model), "--out", "unused", "--lr", "0.02",
        "--is-correction", "mis"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # step 1: the trainer holds version 0, the weights that sampled the batch
    first = trainer.train_on(batch, 1, model, None, optimizer, args)
    assert first["staleness_histogram"] == {"0": int(batch.loss_mask.sum())}
    assert abs(first["is_ratio_mean"] - 1) < 1e-3, first
    assert first["is_filter_drop_frac"] == 0
    # step 3: two optimizer steps later the same batch is two versions stale
    trainer.train_on(batch, 2, model, None, optimizer, args)
    third = trainer.train_on(batch, 3, model, None, optimizer, args)
    assert third["staleness_histogram"] == {"2": int(batch.loss_mask.sum())}
    assert third["is_filter_drop_frac"] > 0, third
    assert abs(third["is_ratio_mean"] - 1) > 1e-3, third


async def test_an_abort_pause_that_meets_a_generation_counts_the_request_it_aborted(
        fresh: VllmProcess, real_redis: aioredis.Redis, tiny_model: Path) -> None:
    settings = TrainerClientSettings(inference_urls=(fresh.url,), pause_mode="abort",
                                     http_timeout_s=60.0, new_run=True)
    body = {"model": "rollq-tiny", "prompt": [5, 6, 7], "max_tokens": 440, "ignore_eos": True,
            "logprobs": 0}
    async with TrainerClient(real_redis, run="aborts", consumer="t", settings=settings) as tc, \
            httpx.AsyncClient(timeout=120) as http:
        for step, head_start in enumerate((0.3, 0.1, 0.02), start=1):
            generation = asyncio.create_task(http.post(f"{fresh.url}/v1/completions",
                                                       json=body))
            await asyncio.sleep(head_start)
            await tc.publish_policy(step, tiny_model)
            finished = (await generation).json()["choices"][0]["finish_reason"]
            if finished == "abort":
                break
        else:
            pytest.fail("no sync met the generation midway")
        assert tc.last_sync is not None and tc.last_sync.aborted_requests == 1
