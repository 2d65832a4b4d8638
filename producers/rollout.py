"""One rollout job: generate a group for one dataset item and publish it.

This is the job body, free of arq: ``producers.worker`` wraps it for the worker pool.
The group id is the job id, so a re-run after a crash publishes the same ``group_id`` and
downstream dedup drops the second copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from rollq.producers.drawn import ItemLedger
from rollq.producers.envs.base import DrawingEnv, Env, Item
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.order import item_index, read_seed
from rollq.producers.publisher import Publisher
from rollq.schemas import ContractError, TrajectoryGroup
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key

log = structlog.get_logger("rollq.rollout")


class PolicyVersionSource:
    """Reads the trainer's published policy version: one HGET per generation call, never
    cached, so a group is never stamped with a version older than the weights it used."""

    def __init__(self, redis: aioredis.Redis, run: str) -> None:
        self.redis = redis
        self.key = state_key(run)

    async def __call__(self) -> int:
        async with translated_errors("reading the policy version"):
            raw = await self.redis.hget(self.key, POLICY_VERSION_FIELD)
        return int(raw) if raw is not None else 0


@dataclass
class RolloutRunner:
    """Everything a job needs, built once per worker process."""

    run: str
    env: Env
    pool: InferencePool
    publisher: Publisher
    sampling: SamplingParams
    group_size: int
    versions: PolicyVersionSource

    def check_job(self, env: str | None, items: int | None) -> None:
        """``ContractError`` unless the job was enqueued for this worker's env: the same
        name and, where the feeder sent it, the same item count (jobs address items by
        position, so another dataset would silently roll out other items). None: not
        known (a job enqueued by hand or by ``rollq dead requeue``)."""
        own = self.env.name
        if env is not None and env != own:
            raise ContractError(f"the job is for env {env!r}, this worker runs {own!r}: start "
                                "`rollq feed` and `rollq workers` with the same --env")
        if items is not None and not isinstance(self.env, DrawingEnv) and items != len(self.env):
            raise ContractError(
                f"the feeder's env {own!r} has {items} items, this worker's has "
                f"{len(self.env)}: start `rollq feed` and `rollq workers` with the same "
                "--env and --env-option")

    async def run_job(self, group_id: str, position: int) -> str:
        """Roll out the dataset item of ``position`` (``producers.order``) and publish it;
        returns the entry id."""
        started = time.time()
        version = await self.versions()
        ledger = None
        if isinstance(self.env, DrawingEnv):  # a stateful source: the same item on a re-run
            ledger = ItemLedger(self.publisher.redis, self.run)
            fields, _drawn = await ledger.item(group_id, self.env.draw)
            item = Item(index=position, fields=fields)
        else:
            seed = await read_seed(self.publisher.redis, self.run)
            item = self.env.item(item_index(position, len(self.env), seed))
        rollout = await self.env.rollout(
            item, self.pool, group_size=self.group_size, sampling=self.sampling,
            policy_version=self.versions,
        )
        group = TrajectoryGroup(
            group_id=group_id,
            run=self.run,
            env=self.env.name,
            policy_version=min([version, *(c.policy_version for c in rollout.completions)]),
            prompt_ids=rollout.prompt_ids,
            prompt_text=rollout.prompt_text,
            prompt_messages=rollout.prompt_messages,
            completions=tuple(rollout.completions),
            metadata=rollout.metadata,
            created_at=started,
            finished_at=time.time(),
        )
        entry_id = await self.publisher.publish(group)
        if ledger is not None:
            await ledger.forget(group_id)
        log.info("group_published", group_id=group_id, entry_id=entry_id,
                 policy_version=group.policy_version, tokens=group.num_tokens)
        return entry_id
