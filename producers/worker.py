"""The arq worker pool: the only module that knows arq.

One arq job = one group for one dataset item of one env. arq gives concurrency
(``max_jobs``), job timeouts, retries with back-off, re-runs of jobs whose worker died
(after the job timeout), and a health key. Jobs travel as msgpack, never pickle.

The job id is ``<run>:<env>:<position>``: enqueueing the same position twice is a no-op
(arq refuses a job id it already holds), and a re-run publishes the same ``group_id``.

What happens when a job fails:
- ``TransientError`` (inference or Redis unavailable): retried with exponential back-off
  up to ``max_tries``;
- ``ContractError`` (e.g. the prompt is too long for the model): retrying cannot help, so
  the failure is published as a dead letter at once;
- after the last try, any error is published as a dead letter with the reason. Either
  way the failure is counted, and the admission budget frees the job's slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from arq import Retry
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.worker import Worker, func

from producers.envs.base import Env
from producers.inference import InferencePool, SamplingParams
from producers.publisher import Publisher
from producers.rollout import PolicyVersionSource, RolloutRunner
from schemas import ContractError, TransientError
from schemas.keys import run_key

log = structlog.get_logger("rollq.worker")
JOB_FUNCTION = "rollout"


def queue_name(run: str) -> str:
    """The arq queue of a run's rollout jobs."""
    return run_key(run, "jobs")


def job_id(run: str, env: str, position: int) -> str:
    return f"{run}:{env}:{position}"


def _serialize(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _deserialize(value: bytes) -> Any:
    return msgpack.unpackb(value, raw=False)


async def connect_queue(redis_url: str) -> ArqRedis:
    """An arq connection for enqueueing (the feeder) with rollq's serializer."""
    return await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=_serialize,
                             job_deserializer=_deserialize)


async def enqueue_rollout(queue: ArqRedis, run: str, env: str, position: int) -> bool:
    """Enqueue the job for ``position``; False when that job id is already known to arq."""
    job = await queue.enqueue_job(JOB_FUNCTION, position, _job_id=job_id(run, env, position),
                                  _queue_name=queue_name(run))
    return job is not None


async def _rollout(ctx: dict[str, Any], position: int) -> str:
    runner: RolloutRunner = ctx["runner"]
    max_tries: int = ctx["max_tries"]
    group_id: str = ctx["job_id"]
    try_number: int = ctx["job_try"]
    structlog.contextvars.bind_contextvars(group_id=group_id, job_try=try_number)
    try:
        return await runner.run_job(group_id, position)
    except ContractError as exc:
        await _give_up(runner, group_id, "rollout_contract_error", exc)
        return "failed"
    except TransientError as exc:
        if try_number < max_tries:
            log.warning("rollout_retried", error=str(exc))
            raise Retry(defer=min(60.0, 2.0 ** try_number)) from exc
        await _give_up(runner, group_id, "rollout_retries_exhausted", exc)
        return "failed"
    except Exception as exc:
        if try_number < max_tries:
            log.exception("rollout_failed")
            raise
        await _give_up(runner, group_id, "rollout_error", exc)
        return "failed"
    finally:
        structlog.contextvars.unbind_contextvars("group_id", "job_try")


async def _give_up(runner: RolloutRunner, group_id: str, reason: str, exc: Exception) -> None:
    detail = f"{type(exc).__name__}: {exc}"
    await runner.publisher.publish_failure(group_id, reason, detail)
    log.error("rollout_dead_lettered", reason=reason, detail=detail)


def build_worker(
    *,
    redis_url: str,
    run: str,
    env_factory: Callable[[], Env],
    inference_urls: list[str],
    model: str | None,
    sampling: SamplingParams,
    group_size: int,
    concurrency: int,
    job_timeout_s: float,
    max_tries: int,
    request_timeout_s: float,
    partitions: int = 1,
    burst: bool = False,
    grace_s: int = 30,
    poll_s: float = 0.02,
    transport: Any = None,
) -> Worker:
    """An arq ``Worker`` that runs rollout jobs of ``run``; ``await worker.main()`` runs it,
    ``burst=True`` returns once the queue is empty (tests)."""

    async def startup(ctx: dict[str, Any]) -> None:
        if "runner" in ctx:  # arq runs on_startup on every main(); keep the first clients
            return
        redis = aioredis.Redis.from_url(redis_url)
        pool = InferencePool(inference_urls, model=model or None, timeout_s=request_timeout_s,
                             transport=transport)
        await pool.__aenter__()
        publisher = Publisher(redis, run, partitions)
        await publisher.register()
        ctx.update(
            rollq_redis=redis,
            inference=pool,
            max_tries=max_tries,
            runner=RolloutRunner(run=run, env=env_factory(), pool=pool, publisher=publisher,
                                 sampling=sampling, group_size=group_size,
                                 versions=PolicyVersionSource(redis, run)),
        )
        log.info("worker_started", run=run, concurrency=concurrency, servers=inference_urls)

    async def shutdown(ctx: dict[str, Any]) -> None:
        if "inference" in ctx:
            await ctx.pop("inference").__aexit__(None, None, None)
        if "rollq_redis" in ctx:
            await ctx.pop("rollq_redis").aclose()
        ctx.pop("runner", None)
        log.info("worker_stopped", run=run)

    return Worker(
        functions=[func(_rollout, name=JOB_FUNCTION, timeout=job_timeout_s,
                        max_tries=max_tries + 1)],  # +1: our own handler gives up on the last
        redis_settings=RedisSettings.from_dsn(redis_url),
        queue_name=queue_name(run),
        max_jobs=concurrency,
        job_timeout=job_timeout_s,
        max_tries=max_tries + 1,
        on_startup=startup,
        on_shutdown=shutdown,
        job_serializer=_serialize,
        job_deserializer=_deserialize,
        health_check_key=run_key(run, "workers:health"),
        health_check_interval=10,
        burst=burst,
        poll_delay=poll_s,  # a finished job's slot waits up to this long for the next job
        job_completion_wait=grace_s,
        handle_signals=not burst,
        keep_result=24 * 3600,  # job ids stay known for a day: re-enqueueing is a no-op
        retry_jobs=True,
    )
