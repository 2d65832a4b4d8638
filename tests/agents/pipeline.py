"""Real workers publish agent groups; they are scored in-process and read by the trainer SDK."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer
from rollq.consumers.trainer import TrainerClient
from rollq.producers.envs.base import Env
from rollq.producers.inference import SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.worker import build_worker, close_worker
from rollq.schemas import ScoredGroup, TrajectoryGroup, decode_trajectory, encode
from rollq.schemas.keys import stream_key
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.producers.fake_vllm import fake_transport
from tests.producers.jobs import enqueue_positions

RUN = "agents"
ENV_SCORE_ONLY = {"components": [{"name": "env", "component": "env_score"}],
                  "advantages": {"zero_variance": "keep"}}


async def run_workers(url: str, redis: aioredis.Redis, env: Env, fake: AgentFakeVLLM | None,
                      positions: list[int], *, inference_url: str | None = None,
                      group_size: int = 2, transport: Any = None) -> list[TrajectoryGroup]:
    """Enqueue ``positions`` and run a burst worker with ``env``; the published groups."""
    await Publisher(redis, RUN).register()
    await enqueue_positions(url, RUN, env.name, positions)
    arq_worker = build_worker(
        redis_url=url, run=RUN, env_factory=lambda: env,
        inference_urls=[inference_url or (fake.base_url if fake else "")], model=None,
        sampling=SamplingParams(max_tokens=96), group_size=group_size, concurrency=2,
        job_timeout_s=60, max_tries=2, request_timeout_s=60, burst=True, retry_base_s=0.01,
        transport=transport if transport is not None else fake_transport(fake) if fake else None)
    try:
        await asyncio.wait_for(arq_worker.main(), 100)
    finally:
        await close_worker(arq_worker)
    return [decode_trajectory(fields) for _, fields in
            await redis.xrange(stream_key(RUN, 0, "traj"))]


async def score_and_train(redis: aioredis.Redis, groups: list[TrajectoryGroup]) -> Any:
    """Score the groups (component ``env_score``), publish them on the scored stream and
    read them back through the trainer SDK; returns the batch (acked)."""
    async with RewardBridge(RewardConfig.from_mapping(ENV_SCORE_ONLY)) as bridge:
        scorer = Scorer(bridge, "env-score")
        for group in groups:
            scored = await scorer.score(group)
            assert isinstance(scored, ScoredGroup), scored
            await redis.xadd(stream_key(RUN, 0, "scored"), encode(scored))  # type: ignore[arg-type]
    async with TrainerClient(redis, run=RUN, consumer="t0") as trainer:
        batch = await trainer.next_batch(groups=len(groups), timeout_s=10)
        assert len(batch) == len(groups)
        await batch.ack()
        return batch
