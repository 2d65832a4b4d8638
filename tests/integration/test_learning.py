"""Proof that a model learns through rollq: the full loop on a real CPU vLLM server.

Real Redis, real vLLM with the tiny model, real `rollq feed/workers/score` processes and the
example GRPO trainer. The control run flips the advantages' sign: if the reward rose for
any reason other than the signal (luck, a bug that rewards anything), it would rise there
too.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.local.demo import (
    DemoOptions,
    Processes,
    read_metrics,
    run_demo,
    start_roles,
    trainer_argv,
)
from rollq.ops.local.stack import VllmProcess
from rollq.producers.publisher import Publisher
from rollq.schemas import decode_trajectory
from rollq.schemas.keys import stream_key
from tests.budget import record_figures
from tests.redis_server import RedisServer

torch = pytest.importorskip("torch", reason="needs the train extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MARGIN = 0.15  # reward points the last 5 steps must gain over the first 5


def options(tmp: Path, run: str, redis_url: str, vllm: VllmProcess, model: Path,
            **overrides: object) -> DemoOptions:
    return DemoOptions(out=tmp / run, run=run, redis_url=redis_url, inference=vllm.url,
                       model=model, **overrides)  # type: ignore[arg-type]


def test_reward_rises_and_the_flipped_control_does_not(
    vllm_server: VllmProcess, redis_server: RedisServer, tiny_model: Path, tmp_path: Path,
    request: pytest.FixtureRequest
) -> None:
    learned = run_demo(options(tmp_path, "learn", redis_server.url, vllm_server, tiny_model,
                               steps=30), say=lambda _: None)
    assert len(learned.steps) == 30
    first, last = learned.reward_at(first=True), learned.reward_at(first=False)
    record_figures(request, f"reward first 5 {first:.3f} -> last 5 {last:.3f} (bar +{MARGIN})")
    assert last > first + MARGIN, f"reward {first:.3f} -> {last:.3f}: did not learn"
    assert learned.plot is not None and learned.plot.stat().st_size > 0
    assert max(step["staleness"] for step in learned.steps) <= 1  # paced, never over the bound

    control = run_demo(options(tmp_path, "control", redis_server.url, vllm_server, tiny_model,
                               steps=30, flip_advantages=True), say=lambda _: None)
    first_c, last_c = control.reward_at(first=True), control.reward_at(first=False)
    record_figures(request, f"reward first 5 {first:.3f} -> last 5 {last:.3f} (bar +{MARGIN}); "
                   f"flipped control {first_c:.3f} -> {last_c:.3f} (bar < +0.02)")
    assert last_c < first_c + 0.02, f"flipped advantages still improved: {first_c} -> {last_c}"


def test_killed_trainer_resumes_and_trains_every_group_exactly_once(
    vllm_server: VllmProcess, redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    opts = options(tmp_path, "resume", redis_server.url, vllm_server, tiny_model, steps=10)
    logs = tmp_path / "resume-logs"
    logs.mkdir()
    processes = Processes(logs)
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_server.url, "ROLLQ_RUN": "resume",
           "ROLLQ_LOG_FORMAT": "json"}
    first_metrics, second_metrics = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    argv = trainer_argv(opts, tiny_model, vllm_server.url, tmp_path / "trainer", first_metrics)
    argv += ["--checkpoint-every", "3"]
    try:
        start_roles(processes, opts, vllm_server.url, env)
        trainer = processes.start("trainer", argv, env)
        deadline = time.monotonic() + 300
        while len(read_metrics(first_metrics)) < 5:  # killed after step 5: checkpoint is step 3
            processes.check()
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.2)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        resumed_argv = [*argv[:argv.index("--metrics") + 1], str(second_metrics),
                        "--checkpoint-every", "3", "--resume"]
        resumed = processes.start("trainer-resumed", resumed_argv, env)
        assert resumed.wait(timeout=300) == 0, (logs / "trainer-resumed.log").read_text()[-2000:]
    finally:
        processes.stop()
    before = [row for row in read_metrics(first_metrics) if row["step"] <= 3]  # in the checkpoint
    after = read_metrics(second_metrics)
    assert [row["step"] for row in after] == list(range(4, 11))
    trained = [gid for row in before + after for gid in row["group_ids"]]
    counts = Counter(trained)
    assert len(trained) == 10 * opts.batch_groups
    assert max(counts.values()) == 1, "a group was trained twice into the final weights"
    lost = {gid for row in read_metrics(first_metrics) if row["step"] > 3
            for gid in row["group_ids"]}
    assert lost and lost <= set(trained), "groups acked after the checkpoint were not replayed"


async def test_weight_reload_changes_outputs_and_stamped_version(
    vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
    tiny_model: Path, tmp_path: Path
) -> None:
    prompt = {"model": vllm_server.served_name, "prompt": [5, 6, 7, 8], "max_tokens": 8,
              "temperature": 0, "logprobs": 0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as http:
        before = (await http.post("/v1/completions", json=prompt)).json()["choices"][0]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model, torch_dtype=torch.float32)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
        model.save_pretrained(tmp_path / "perturbed", safe_serialization=True)
        await Publisher(real_redis, "reload").register()
        settings = TrainerClientSettings(inference_urls=(vllm_server.url,), new_run=True)
        async with TrainerClient(real_redis, run="reload", consumer="t",
                                 settings=settings) as client:
            try:
                assert await client.publish_policy(7, tmp_path / "perturbed") == 7
                after = (await http.post("/v1/completions", json=prompt)).json()["choices"][0]
                assert after["token_ids"] != before["token_ids"]
                # What the server served before is whatever the last test left (a trained
                # policy may stop early): the logprobs differ in length or in value.
                after_lp = after["logprobs"]["token_logprobs"]
                before_lp = before["logprobs"]["token_logprobs"]
                assert len(after_lp) != len(before_lp) or not np.allclose(after_lp, before_lp)
                from rollq.producers.envs.registry import make_env
                from rollq.producers.inference import SamplingParams
                from rollq.producers.worker import (
                    build_worker,
                    close_worker,
                    connect_queue,
                    enqueue_rollout,
                )

                queue = await connect_queue(redis_server.url)
                await enqueue_rollout(queue, "reload", "gsm8k", 0)
                await queue.aclose()
                worker = build_worker(
                    redis_url=redis_server.url, run="reload", env_factory=lambda: make_env("gsm8k"),
                    inference_urls=[vllm_server.url], model=None,
                    sampling=SamplingParams(max_tokens=8), group_size=2, concurrency=1,
                    job_timeout_s=60, max_tries=2, request_timeout_s=60, burst=True)
                await worker.main()
                await close_worker(worker)
                (entry,) = await real_redis.xrange(stream_key("reload", 0, "traj"))
                assert decode_trajectory(entry[1]).policy_version == 7
            finally:
                await client.publish_policy(8, tiny_model)  # leave the server as it was
