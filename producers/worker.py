"""The arq worker pool: the only module that knows arq.

One arq job = one group for one dataset item of one env. arq gives concurrency
(``max_jobs``), retries with back-off, re-runs of jobs whose worker died (after the job
timeout), and a health key. Jobs travel as msgpack, never pickle.

The job id is ``<run>:<env>:<position>``: enqueueing the same position twice is a no-op
(arq refuses a job id it already holds), and a re-run publishes the same ``group_id``.

Every try of a job ends in exactly one of (``schemas.failures.decide``, with
``retry_unexpected`` on: an env may be flaky):

- **done**: the group is published;
- **retry**: a transient failure (inference or Redis unavailable, the try ran past the job
  timeout) or any unexpected exception while tries remain: ``arq.Retry`` with exponential
  back-off, so arq really runs it again;
- **dead letter**: a contract failure at once, anything else on the last try:
  ``Publisher.publish_failure`` writes the dead letter and counts ``drop:<reason>`` in one
  MULTI, which frees the job's admission slot. ``rollq dead requeue`` re-enqueues it.

A worker killed mid-job (SIGKILL, OOM) leaves the job in arq's queue under an in-progress
key that expires ``job timeout + TIMEOUT_MARGIN_S + 10 s`` after the try started; then any
worker runs it again as the next try (tested against a real redis-server). A try cut short
by a graceful stop (SIGINT/SIGTERM past the grace period) goes back to the queue and is not
counted as a try: the shutdown was not the job's fault.

Why no job can vanish in arq's result store, holding its admission slot forever (arq
records a job as failed, never to run again and never seen by our code, when the job
raises anything but ``Retry``, when it exceeds arq's own timeout, when its try count
exceeds arq's ``max_tries``, or when its job key expired before any worker took it):

- the job body catches every exception and ends in ``Retry`` or in a dead letter written
  before it returns normally; if the dead letter itself cannot be written (Redis away or
  refusing the write), it raises ``Retry`` so that a later try writes it;
- it enforces the job timeout itself, ``TIMEOUT_MARGIN_S`` before arq's, and closes the
  try's gateway episodes as the timeout expires (or the try is cancelled or fails), even
  while an agent that ignores the cancellation still runs (``producers.envs.episode``);
- arq's ``max_tries`` is ``EXTRA_TRIES`` above rollq's, so a try that arq starts after the
  last allowed try's worker died (or could not write its dead letter) still reaches the
  body, which dead-letters the job (``job_timeout``) without running it again;
- jobs are enqueued with a job key that lives ``JOB_EXPIRY_S`` (30 days, arq's default is
  one day), so workers that are down over a weekend do not expire the queue.

What remains is arq's last resort: a job whose ``EXTRA_TRIES`` extra tries all failed to
write their dead letter, which needs Redis to accept arq's own writes and refuse ours five
times over minutes of back-off; ``rollq status`` reports such a group as admitted but in no
stream, queue or dead letter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog
from arq import Retry
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.constants import job_key_prefix, result_key_prefix, retry_key_prefix
from arq.worker import Worker, func

from rollq.producers.envs.base import Env, close_env
from rollq.producers.envs.episode import JobEpisodes, job_episodes
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.rollout import PolicyVersionSource, RolloutRunner
from rollq.schemas import BrokerUnavailable, ConfigError
from rollq.schemas.breaker import record_failure, record_success
from rollq.schemas.errors import refusals_named
from rollq.schemas.failures import JOB_TIMEOUT, Action, Kind, Verdict, backoff_s, classify, decide
from rollq.schemas.heap import startup_done

# a run's job ids and queue, named with its keys (no arq there); re-exported
from rollq.schemas.keys import HEALTH_INTERVAL_S, HEALTH_KEY, run_key
from rollq.schemas.keys import job_id as job_id
from rollq.schemas.keys import parse_job_id as parse_job_id
from rollq.schemas.keys import queue_name as queue_name
from rollq.schemas.tls import url_tls_options

log = structlog.get_logger("rollq.worker")
JOB_FUNCTION = "rollout"
JOB_EXPIRY_S = 30 * 24 * 3600
"""A queued job's key lives this long (arq fails a job whose key expired without running
it; its default of a day would silently leak the slots of a weekend's queue)."""


def _serialize(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _deserialize(value: bytes) -> Any:
    return msgpack.unpackb(value, raw=False)


def queue_settings(redis_url: str, options: Mapping[str, Any] | None = None) -> RedisSettings:
    """arq's connection settings: its DSN parser keeps the user, password and ``rediss``
    scheme but drops TLS files, so the redis-py ``options`` (``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``) are set on it explicitly, and the
    URL's own ``ssl_*`` query options over them (as redis-py does for its clients)."""
    settings = RedisSettings.from_dsn(redis_url)
    for name, value in {**(options or {}), **url_tls_options(redis_url)}.items():
        if name.startswith("ssl_"):
            setattr(settings, name, value)
    return settings


async def connect_queue(redis_url: str, options: Mapping[str, Any] | None = None) -> ArqRedis:
    """An arq connection for enqueueing (the feeder) with rollq's serializer."""
    return await create_pool(queue_settings(redis_url, options), job_serializer=_serialize,
                             job_deserializer=_deserialize,
                             expires_extra_ms=int(JOB_EXPIRY_S * 1000))


async def enqueue_rollout(queue: ArqRedis, run: str, env: str, position: int, *,
                          items: int | None = None) -> bool:
    """Enqueue the job for ``position``; False when that job id is already known to arq.

    The job carries the env's name and, from a feeder, its item count, so a worker whose
    env differs (feed and workers started with another ``--env`` or ``--env-option``)
    dead-letters the job instead of rolling out another item under its id."""
    with refusals_named(queue.connection_pool.connection_kwargs.get("username"),
                        ("arq-enqueue", queue_name(run),
                         job_key_prefix + job_id(run, env, position))):
        job = await queue.enqueue_job(JOB_FUNCTION, position, env=env, items=items,
                                      _job_id=job_id(run, env, position),
                                      _queue_name=queue_name(run))
    return job is not None


TIMEOUT_MARGIN_S = 5.0
"""arq's own job timeout is this much longer than the one the job body enforces (by
default; ``build_worker(timeout_margin_s=)``): time enough to write a dead letter."""
EXTRA_TRIES = 5
"""arq's ``max_tries`` is this much above rollq's (see the module docstring)."""
OUTCOMES = "rollq_outcomes"
"""Key of the worker's ``ctx``: a ``Counter`` of how its jobs ended, ``PUBLISHED`` or
``DEAD_LETTERED`` (arq gives each job a copy of ``ctx``; the counter is shared)."""
PUBLISHED, DEAD_LETTERED = "published", "dead_lettered"
ON_REFUSED = "rollq_on_refused"
"""Key of the worker's ``ctx``: called with a ``ConfigError`` a job met (``build_worker``'s
``on_refused``)."""


async def _rollout(ctx: dict[str, Any], position: int, env: str | None = None,
                   items: int | None = None) -> str:
    runner: RolloutRunner = ctx["runner"]
    max_tries: int = ctx["max_tries"]
    timeout_s: float = ctx["job_timeout_s"]
    retry_base_s: float = ctx.get("retry_base_s", 1.0)
    group_id: str = ctx["job_id"]
    try_number: int = ctx["job_try"]
    structlog.contextvars.bind_contextvars(group_id=group_id, job_try=try_number)
    try:
        if try_number > max_tries:  # the last try's worker died, or its dead letter failed
            verdict = Verdict(
                Action.DEAD_LETTER, JOB_TIMEOUT,
                f"after {max_tries} tries: the last try did not finish (its worker died, "
                f"it ran past the {timeout_s} s job timeout, or its dead letter could not "
                f"be written)")
        else:
            deadline = asyncio.timeout(timeout_s)
            with job_episodes() as episodes:
                due = _close_when_due(timeout_s, episodes)
                try:
                    async with deadline:
                        runner.check_job(env, items)
                        entry_id = await runner.run_job(group_id, position)
                    ctx[OUTCOMES][PUBLISHED] += 1
                    await _streak(record_success(runner.publisher.redis, runner.run))
                    return entry_id
                except asyncio.CancelledError:
                    # A graceful stop past its grace period (or arq's own timeout): arq puts
                    # the job back in the queue; the try it took is given back.
                    await asyncio.shield(episodes.close_all("the try was cancelled"))
                    await asyncio.shield(_uncount_try(ctx))
                    raise
                except ConfigError as exc:
                    raise await _refused(ctx, exc) from exc
                except Exception as caught:
                    # past the deadline, a timeout of the try's own tasks (a TaskGroup's
                    # group of them) is the try's timeout
                    exc = (_ran_past(timeout_s, caught) if deadline.expired()
                           and _timed_out(caught) else caught)
                    await asyncio.shield(episodes.close_all("the try failed"))
                finally:
                    due.cancel()
                verdict = decide(exc, attempt=try_number, max_attempts=max_tries,
                                 retry_unexpected=True)
                if verdict.retry:
                    defer = backoff_s(try_number, base_s=retry_base_s)
                    log.warning("rollout_retried", reason=verdict.reason,
                                detail=verdict.detail, defer_s=defer,
                                servers=runner.pool.base_urls)
                    raise Retry(defer=defer) from exc
                if classify(exc).kind is Kind.UNEXPECTED:
                    log.error("rollout_failed", exc_info=exc)
        try:
            await _give_up(runner, group_id, verdict)
        except ConfigError as exc:  # the dead letter refused: the role's error, not the job's
            raise await _refused(ctx, exc) from exc
        except Exception as exc:  # Redis away or refusing the write (BrokerUnavailable, a
            # ResponseError): arq must not record the job as failed; a later try writes it
            defer = backoff_s(try_number, base_s=retry_base_s)
            log.warning("rollout_dead_letter_deferred", reason=verdict.reason,
                        error=f"{type(exc).__name__}: {exc}", defer_s=defer)
            raise Retry(defer=defer) from exc
        ctx[OUTCOMES][DEAD_LETTERED] += 1
        return "dead_lettered"
    finally:
        structlog.contextvars.unbind_contextvars("group_id", "job_try")


_CLOSING: set[asyncio.Task[int]] = set()  # closes under way (the loop keeps weak references)


def _close_when_due(timeout_s: float, episodes: JobEpisodes) -> asyncio.TimerHandle:
    """Close the try's open gateway episodes as its timeout expires, without waiting for the
    try to unwind: an agent that ignores the cancellation must not hold them
    (``producers.envs.episode``)."""
    loop = asyncio.get_running_loop()

    def due() -> None:
        task = loop.create_task(episodes.close_all("the try ran past its timeout"))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    return loop.call_later(timeout_s, due)


def _timed_out(exc: BaseException) -> bool:
    """A TimeoutError, or an exception group holding one."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(TimeoutError) is not None
    return isinstance(exc, TimeoutError)


def _ran_past(timeout_s: float, cause: BaseException) -> TimeoutError:
    error = TimeoutError(f"the try ran past the {timeout_s:g} s job timeout")
    error.__cause__ = cause
    return error


async def _refused(ctx: dict[str, Any], exc: ConfigError) -> Retry:
    """A try that met a configuration error (Redis refused the user a command or a key, a
    certificate): neither the job's failure nor a dead letter. The job goes back to the
    queue (its try given back) and the pool is told to stop (``on_refused``: exit 78)."""
    log.error("rollout_refused", error=str(exc))
    await asyncio.shield(_uncount_try(ctx))
    on_refused: Callable[[ConfigError], None] | None = ctx.get(ON_REFUSED)
    if on_refused is not None:
        on_refused(exc)
    return Retry(defer=ctx.get("retry_base_s", 1.0))


async def _uncount_try(ctx: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):  # best effort: at worst the stop costs a try
        await ctx["redis"].decr(retry_key_prefix + ctx["job_id"])


async def _give_up(runner: RolloutRunner, group_id: str, verdict: Verdict) -> None:
    await runner.publisher.publish_failure(group_id, verdict.reason, verdict.detail)
    log.error("rollout_dead_lettered", reason=verdict.reason, detail=verdict.detail,
              servers=runner.pool.base_urls)
    await _streak(record_failure(runner.publisher.redis, runner.run, verdict.reason,
                                 verdict.detail))


async def _streak(update: Awaitable[object]) -> None:
    """Update the run's failure streak (``schemas.breaker``) after the job's outcome is
    written: the outcome stands either way, so a Redis failure here is logged, not retried
    (a streak missed by one job trips the breaker one job later)."""
    try:
        await update
    except (BrokerUnavailable, redis_errors.RedisError) as exc:
        log.warning("failure_streak_not_updated", error=f"{type(exc).__name__}: {exc}")


async def requeue_rollout(queue: ArqRedis, run: str, env: str, position: int) -> bool:
    """Enqueue the job of ``position`` again after it was dead-lettered: arq keeps a
    finished job's result (and so its id) for ``result_ttl_s``, which would refuse the new
    job, so its result, job and try-count keys are removed first; the job starts again at
    try 1 and publishes the same ``group_id``. Returns False when the job is queued or
    running now (nothing to requeue)."""
    ident = job_id(run, env, position)
    if await queue.zscore(queue_name(run), ident) is not None:
        return False
    await queue.delete(*(prefix + ident for prefix in (result_key_prefix, job_key_prefix,
                                                       retry_key_prefix)))
    return await enqueue_rollout(queue, run, env, position)


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
    retry_base_s: float = 1.0,
    result_ttl_s: float = 600.0,
    timeout_margin_s: float = TIMEOUT_MARGIN_S,
    max_entry_bytes: int | None = None,
    logprobs_mode: str | None = None,
    lora_name: str | None = None,
    redis_options: Mapping[str, Any] | None = None,
    transport: Any = None,
    name: str | None = None,
    open_data: Callable[[], aioredis.Redis] | None = None,
    on_refused: Callable[[ConfigError], None] | None = None,
) -> Worker:
    """An arq ``Worker`` that runs rollout jobs of ``run``; ``await worker.main()`` runs it,
    ``burst=True`` returns once the queue is empty (tests).

    ``redis_url`` (with ``redis_options``) is arq's queue; the groups go to the client
    ``open_data`` makes (default: one on ``redis_url``), e.g. a Redis Cluster's.
    ``on_refused`` is called when a job meets a configuration error (the pool should stop:
    no job can succeed until the setting is fixed)."""

    async def startup(ctx: dict[str, Any]) -> None:
        if "runner" in ctx:  # arq runs on_startup on every main(); keep the first clients
            return
        redis = (open_data() if open_data is not None
                 else aioredis.Redis.from_url(redis_url, **(redis_options or {})))
        publisher = Publisher(redis, run, partitions, max_entry_bytes=max_entry_bytes)
        try:  # Redis first: a failed start-up (Redis away) leaves nothing open behind
            await publisher.register()
        except BaseException:
            await redis.aclose()
            raise
        versions = PolicyVersionSource(redis, run)
        pool = InferencePool(inference_urls, model=model or None, timeout_s=request_timeout_s,
                             logprobs_mode=logprobs_mode, lora_name=lora_name or None,
                             policy_version=versions, transport=transport)
        await pool.__aenter__()
        ctx.update(
            rollq_redis=redis,
            rollq_outcomes=Counter(),
            inference=pool,
            max_tries=max_tries,
            job_timeout_s=job_timeout_s,
            retry_base_s=retry_base_s,
            rollq_on_refused=on_refused,
            runner=RolloutRunner(run=run, env=env_factory(), pool=pool, publisher=publisher,
                                 sampling=sampling, group_size=group_size,
                                 versions=versions),
        )
        log.info("worker_started", run=run, concurrency=concurrency, servers=inference_urls)
        startup_done()

    async def shutdown(ctx: dict[str, Any]) -> None:
        if "runner" in ctx:  # an env's own server or connections first
            await close_env(ctx["runner"].env)
        if "inference" in ctx:
            await ctx.pop("inference").__aexit__(None, None, None)
        if "rollq_redis" in ctx:
            await ctx.pop("rollq_redis").aclose()
        ctx.pop("runner", None)
        log.info("worker_stopped", run=run)

    arq_timeout_s = job_timeout_s + timeout_margin_s  # the body times out first
    return Worker(
        functions=[func(_rollout, name=JOB_FUNCTION, timeout=arq_timeout_s,
                        max_tries=max_tries + EXTRA_TRIES)],
        redis_settings=queue_settings(redis_url, redis_options),
        queue_name=queue_name(run),
        max_jobs=concurrency,
        job_timeout=arq_timeout_s,
        max_tries=max_tries + EXTRA_TRIES,
        on_startup=startup,
        on_shutdown=shutdown,
        job_serializer=_serialize,
        job_deserializer=_deserialize,
        health_check_key=run_key(run, HEALTH_KEY + (
            name or f"{socket.gethostname()}-{os.getpid()}")),
        health_check_interval=HEALTH_INTERVAL_S,
        burst=burst,
        poll_delay=poll_s,  # a finished job's slot waits up to this long for the next job
        job_completion_wait=grace_s,
        handle_signals=False,  # ops.roles maps SIGINT/SIGTERM to a graceful stop
        expires_extra_ms=int(JOB_EXPIRY_S * 1000),
        # A finished job's id stays known this long, so a feeder that re-enqueues the
        # position at its cursor after a crash (seconds later) is refused; after that the
        # result expires and Redis stays flat over a weeks-long run (the trainer's
        # group_id dedup stays the backstop).
        keep_result=result_ttl_s,
        retry_jobs=True,
    )


async def close_worker(worker: Worker) -> None:
    """Stop a worker's jobs in hand and close it, connections included.

    arq's own ``close`` cancels the jobs in hand, then gathers them without
    ``return_exceptions``: a job cancelled before its handler's ``try`` (while it reads the job
    from Redis) ends cancelled, the gather raises ``CancelledError``, and the pool's connections
    are never closed. Here every job task is cancelled and awaited first (arq leaves a
    cancelled job in its queue, to run again), so ``close`` finds none left."""
    tasks = list(worker.tasks.values())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    worker.tasks.clear()
    await worker.close()
