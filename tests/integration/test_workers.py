"""Real workers against a real CPU vLLM server: what lands in the stream is what vLLM said."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.ops.local.stack import VllmProcess
from rollq.producers.envs.registry import make_env
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.producers.inference import SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.worker import (
    build_worker,
    close_worker,
    connect_queue,
    enqueue_rollout,
    job_id,
    queue_name,
)
from rollq.schemas import decode_trajectory
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key, stream_key
from tests.integration.recording import RecordingTransport
from tests.redis_server import RedisServer
from tests.waiting import until

pytestmark = pytest.mark.vllm
RUN = "itest"


def worker(url: str, vllm: VllmProcess, env: str = "gsm8k", *, transport: object = None,
           max_tokens: int = 24, **options: object) -> object:
    return build_worker(
        redis_url=url, run=RUN, env_factory=lambda: make_env(env, **options),
        inference_urls=[vllm.url], model=None,
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens),
        group_size=4, concurrency=4, job_timeout_s=60, max_tries=3, request_timeout_s=60,
        burst=True, transport=transport)


async def traj_groups(redis: aioredis.Redis) -> list[object]:
    return [decode_trajectory(f) for _, f in await redis.xrange(stream_key(RUN, 0, "traj"))]


async def test_workers_publish_exactly_what_vllm_returned(
    vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis
) -> None:
    queue = await connect_queue(redis_server.url)
    for position in range(3):
        assert await enqueue_rollout(queue, RUN, "gsm8k", position)
    await queue.aclose()
    recorder = RecordingTransport()
    arq_worker = worker(redis_server.url, vllm_server, transport=recorder)
    await arq_worker.main()  # type: ignore[attr-defined]
    await close_worker(arq_worker)

    groups = await traj_groups(real_redis)
    assert sorted(g.group_id for g in groups) == [job_id(RUN, "gsm8k", p) for p in range(3)]
    replies = recorder.replies("/v1/chat/completions")
    assert len(replies) == 3
    by_prompt = {tuple(r["prompt_token_ids"]): r for r in replies}
    for group in groups:
        reply = by_prompt[tuple(group.prompt_ids.tolist())]  # prompt ids exactly as served
        assert len(group.completions) == 4 and group.metadata["answer"]
        for completion, choice in zip(group.completions, reply["choices"], strict=True):
            assert completion.completion_ids.tolist() == choice["token_ids"]
            served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            assert np.allclose(completion.logprobs, served, atol=0, rtol=0)
            assert completion.loss_mask.tolist() == [1] * len(choice["token_ids"])
            assert completion.finish_reason == choice["finish_reason"]
            assert completion.policy_version == 0


async def test_multi_turn_episode_masks_env_tokens(
    vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis
) -> None:
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, "guess", 0)
    await queue.aclose()
    recorder = RecordingTransport()
    # the random model's 8-token replies are cut (finish_reason length): sent to the env
    # anyway, so the episodes go on and have observations to mask
    arq_worker = worker(redis_server.url, vllm_server, "guess", transport=recorder,
                        max_tokens=8, max_guesses=3, truncated_turn="send")
    await arq_worker.main()  # type: ignore[attr-defined]
    await close_worker(arq_worker)
    (group,) = await traj_groups(real_redis)
    served = {tuple(choice["token_ids"]): [e for e in choice["logprobs"]["token_logprobs"]]
              for reply in recorder.replies("/v1/completions") for choice in reply["choices"]}
    multi_turn = 0
    for completion in group.completions:
        mask = completion.loss_mask.astype(bool)
        ids = completion.completion_ids
        assert mask[0], "the completion starts with the model's first turn"
        # every run of model tokens is a reply vLLM actually sent, with its logprobs
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        for run in runs:
            if mask[run[0]]:
                assert tuple(ids[run].tolist()) in served
                assert np.allclose(completion.logprobs[run], served[tuple(ids[run].tolist())])
            else:
                assert (completion.logprobs[run] == 0).all()  # env tokens: masked, no logprob
                multi_turn += 1
        assert len(completion.turn_rewards) >= 1
    assert multi_turn > 0, "at least one episode had an env observation between turns"


async def test_killed_worker_job_is_rerun_with_the_same_group_id(
    vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis,
    tmp_path: object,
) -> None:
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, "gsm8k", 7)
    await queue.aclose()
    env = {**os.environ, "ROLLQ_LOG_FORMAT": "json"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "workers", "--redis-url", redis_server.url,
        "--run", RUN, "--inference", vllm_server.url, "--group-size", "8",
        "--max-tokens", "400", env={**env, "ROLLQ_JOB_TIMEOUT_S": "3"},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    in_progress = f"arq:in-progress:{job_id(RUN, 'gsm8k', 7)}"
    await until(lambda: real_redis.exists(in_progress), "the worker to start the job")
    process.send_signal(signal.SIGKILL)  # dies mid-generation, job unacknowledged
    await process.wait()
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 0

    # arq re-runs the job once its in-progress lock expires (job timeout + 10 s)
    rerun = build_worker(
        redis_url=redis_server.url, run=RUN, env_factory=lambda: make_env("gsm8k"),
        inference_urls=[vllm_server.url], model=None,
        sampling=SamplingParams(max_tokens=8), group_size=2, concurrency=1, job_timeout_s=3,
        max_tries=3, request_timeout_s=60, burst=True)
    for _ in range(40):
        await rerun.main()
        if await real_redis.xlen(stream_key(RUN, 0, "traj")):
            break
        await asyncio.sleep(1)
    await close_worker(rerun)
    (group,) = await traj_groups(real_redis)
    assert group.group_id == job_id(RUN, "gsm8k", 7)  # a second copy would carry the same id


async def test_feeder_paces_real_workers_by_the_published_version(
    vllm_server: VllmProcess, redis_server: RedisServer, real_redis: aioredis.Redis
) -> None:
    queue = await connect_queue(redis_server.url)
    await Publisher(real_redis, RUN).register()

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, "gsm8k", position)

    feeder = Feeder(real_redis, RUN, FeedPlan(dataset_size=200, epochs=1, max_staleness=0,
                                              batch_groups=2), enqueue)
    assert await feeder.feed_once() == 2
    arq_worker = worker(redis_server.url, vllm_server)
    await arq_worker.main()  # type: ignore[attr-defined]
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 2
    assert await feeder.feed_once() == 0  # the trainer has not moved: paused
    await real_redis.hset(state_key(RUN), POLICY_VERSION_FIELD, "1")
    await real_redis.hincrby(f"rollq:{{{RUN}:0}}:counters", "consumed", 2)
    assert await feeder.feed_once() == 2  # version 1 published: resumed
    await arq_worker.main()  # type: ignore[attr-defined]
    await close_worker(arq_worker)
    await queue.aclose()
    groups = await traj_groups(real_redis)
    assert len(groups) == 4
    assert sorted(g.policy_version for g in groups) == [0, 0, 1, 1]  # stamped with the version


async def test_workers_with_a_model_vllm_does_not_serve_exit_78_in_seconds(
        real_redis: aioredis.Redis, redis_server: RedisServer, vllm_server: VllmProcess,
) -> None:
    """Issue 32, item 1, against the real server: no job is taken, nothing is dead-lettered,
    and the line names what vLLM serves."""
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, "gsm8k", 0)
    await queue.aclose()
    started = asyncio.get_running_loop().time()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "workers", "--redis-url", redis_server.url,
        "--run", RUN, "--inference", vllm_server.url, "--model", "Qwen/Qwen3-8B",
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 78, err.decode()[-2000:]
    # in seconds, having taken no job: ~3 s quietly, the process's start included; the bound
    # leaves room for a loaded machine and is far from any job timeout
    assert asyncio.get_running_loop().time() - started < 60
    served = (await vllm_server_models(vllm_server))[0]
    assert f"{vllm_server.url} serves {served}" in err.decode()
    assert await real_redis.zcard(queue_name(RUN)) == 1
    for name in ("traj", "dead"):
        assert await real_redis.xlen(stream_key(RUN, 0, name)) == 0


async def vllm_server_models(vllm: VllmProcess) -> list[str]:
    import httpx

    async with httpx.AsyncClient() as client:
        body = (await client.get(f"{vllm.url}/v1/models")).json()
    return [entry["id"] for entry in body["data"]]
