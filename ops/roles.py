"""Wiring of the long-running roles: scorer, worker pool, feeder (rescore: ``ops.rescore``).

Each ``run_*`` coroutine owns its clients, runs until its ``stop`` event is set (by
SIGINT/SIGTERM at the CLI edge) or its work is done, and closes everything on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog

from rollq.consumers.bus import StreamReader, trim_streams
from rollq.consumers.housekeeping import forget_idle_consumers, trim_dead
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.consumers.scorer.config import RewardConfig
from rollq.consumers.scorer.consumer import Scorer, config_fingerprint
from rollq.consumers.stage import Stage
from rollq.consumers.trainer.client import TRAINER_GROUP
from rollq.ops.connections import (
    open_queue_redis,
    open_redis,
    queue_options,
    queue_url,
    redis_options,
)
from rollq.ops.health import waiting_for_inference
from rollq.ops.looplag import LoopLagMonitor
from rollq.ops.role_metrics import feeder_metrics, worker_metrics
from rollq.ops.settings import (
    CommonSettings,
    FeederSettings,
    ReaderTuning,
    ScorerSettings,
    WorkerSettings,
)
from rollq.ops.watchdog import RunWatchdog, warn_if_unknown, watching
from rollq.ops.watchdog import log as watchdog_log
from rollq.ops.watching import Watched, probe_command, ride_out
from rollq.producers.envs.base import Env
from rollq.producers.envs.registry import make_env
from rollq.producers.feeder import Feeder, FeedPlan, record_plan
from rollq.producers.inference import SamplingParams
from rollq.producers.inference.served import check_served
from rollq.producers.order import record_seed
from rollq.producers.publisher import Publisher
from rollq.producers.worker import (
    build_worker,
    close_worker,
    connect_queue,
    enqueue_rollout,
    queue_name,
    requeue_rollout,
)
from rollq.schemas import BrokerUnavailable, ConfigError, breaker
from rollq.schemas.errors import REFUSALS, access_refused
from rollq.schemas.heap import startup_done
from rollq.schemas.keys import PARTITIONS_FIELD, state_key, stream_keys
from rollq.schemas.outage import OutageRider, StoppedDuringOutage

if TYPE_CHECKING:
    from rollq.ops.metrics import RoleMetrics

log = structlog.get_logger("rollq.roles")

DEFAULT_REWARD = {
    "components": [
        {"name": "accuracy", "component": "accuracy",
         "settings": {"kind": "gsm8k", "gold_field": "answer"}},
        {"name": "format", "component": "format", "weight": 0.2,
         "settings": {"preset": "think"}},
    ],
    "advantages": {"method": "grpo", "zero_variance": "drop"},
}


def consumer_name(settings: ReaderTuning, role: str) -> str:
    return settings.consumer or f"{role}-{socket.gethostname()}-{os.getpid()}"


def load_reward_config(path: Path | None, *, processes: int | None = None) -> RewardConfig:
    """The reward config from YAML, or the default gsm8k accuracy + think-format bridge."""
    config = RewardConfig.from_yaml(path) if path else RewardConfig.from_mapping(DEFAULT_REWARD)
    if processes is not None:
        config = config.model_copy(update={"pool": config.pool.model_copy(
            update={"workers": processes})})
    return config


async def _partitions(redis: aioredis.Redis, run: str, default: int) -> int:
    raw = await redis.hget(state_key(run), PARTITIONS_FIELD)
    if raw is None:  # first role to touch the run registers it
        return await Publisher(redis, run, default).register()
    return int(raw)


async def run_scorer(settings: ScorerSettings, stop: asyncio.Event, *,
                     burst: bool = False) -> Stage:
    """Score the run's traj streams until ``stop`` (or, with ``burst``, until empty)."""
    config = load_reward_config(settings.reward_config, processes=settings.processes)
    redis = open_redis(settings)
    try:
        existed = await warn_if_unknown(redis, settings.run, "scorer")
        partitions = await _partitions(redis, settings.run, settings.partitions)
        reader = StreamReader(redis, stream_keys(settings.run, partitions, "traj"), "scorers",
                              consumer_name(settings, "scorer"),
                              settings.reader_settings(settings.concurrency))
        async with RewardBridge(config) as bridge:
            notice = breaker.Notice(settings.run, "scorer", watchdog_log)
            scorer = Scorer(bridge, config_fingerprint(config), redis, run=settings.run,
                            zero_variance_breaker=settings.zero_variance_breaker,
                            notice=notice)
            stage = Stage(reader, scorer, concurrency=settings.concurrency)
            log.info("scorer_started", run=settings.run, consumer=reader.consumer,
                     reward_config=scorer.config_name)
            startup_done()
            if burst:
                await stage.drain()
                return stage
            await reader.ensure_groups()
            trimmed_at = time.monotonic()
            rider = OutageRider(give_up_s=settings.redis_give_up_s, what="scorer", log=log,
                                stop=stop)

            async def step() -> None:
                nonlocal trimmed_at
                deliveries = await reader.next_deliveries()
                if deliveries:
                    await stage.process(deliveries)
                if time.monotonic() - trimmed_at > settings.trim_every_s:
                    # Both streams of the run: nothing unacked is ever trimmed, so the
                    # scorers can keep the trainer's stream in bounds too.
                    trimmed_at = time.monotonic()
                    try:
                        await trim_streams(redis, [*reader.streams, *stream_keys(
                            settings.run, partitions, "scored")],
                            int(settings.retention_s * 1000))
                    except redis_errors.ResponseError as exc:  # housekeeping, not the work:
                        # a trim Redis refuses is retried next cycle, never a scorer exit
                        log.warning("streams_trim_failed", run=settings.run, detail=str(exc))
                    await housekeeping(redis, settings, partitions, reader.consumer)

            async with LoopLagMonitor("scorer") as lag, serve_metrics(
                    settings, "scorer", lag, stage_metrics(stage)), watching(RunWatchdog(
                        redis, settings.run, "scorer", stall_s=settings.stall_warning_s,
                        existed=existed, notice=notice)):
                while not stop.is_set():
                    outages = rider.outages
                    try:
                        await rider.call(step)
                        if rider.outages > outages:  # what was in hand when Redis went: now
                            await rider.call(lambda: own_pending(reader, stage))
                    except StoppedDuringOutage:
                        break  # what was in hand stays pending for the next scorer
            log.info("scorer_stopped", forwarded=stage.forwarded, dropped=stage.dropped,
                     dead_lettered=stage.dead_lettered)
            return stage
    finally:
        await redis.aclose()


async def housekeeping(redis: aioredis.Redis, settings: ScorerSettings, partitions: int,
                       consumer: str) -> None:
    """What keeps a long run flat besides trimming: dead letters past their retention, and
    consumers that restarted roles left behind (see ``consumers.housekeeping``)."""
    idle_ms = int(settings.consumer_idle_s * 1000)
    removed = await forget_idle_consumers(redis, stream_keys(settings.run, partitions, "traj"),
                                          "scorers", idle_ms, keep=consumer)
    removed += await forget_idle_consumers(
        redis, stream_keys(settings.run, partitions, "scored"), TRAINER_GROUP, idle_ms)
    dead = await trim_dead(redis, stream_keys(settings.run, partitions, "dead"),
                           int(settings.dead_retention_s * 1000))
    if removed or dead:
        log.info("housekeeping_done", consumers_removed=removed, dead_letters_trimmed=dead)


def stage_metrics(stage: Stage) -> Callable[[RoleMetrics], None]:
    """Register a stage's outcome counts with a role's metrics."""

    def register(metrics: RoleMetrics) -> None:
        for outcome in ("forwarded", "dropped", "dead_lettered", "left_pending"):
            metrics.add_counter("rollq_stage_entries", "Entries this process handled, by "
                                "outcome (left_pending: failures left for a retry)",
                                lambda outcome=outcome: getattr(stage, outcome),
                                outcome=outcome)

    return register


@contextlib.asynccontextmanager
async def serve_metrics(settings: CommonSettings, role: str, lag: LoopLagMonitor,
                        *extra: Callable[[RoleMetrics], None]) -> AsyncIterator[None]:
    """Serve the role's ``/metrics`` while the block runs, when ``metrics_port`` is set."""
    if settings.metrics_port is None:
        yield
        return
    from rollq.ops.metrics import RoleMetrics

    queue: str | None = None
    if role in ("workers", "feeder"):  # the workers' health series: a SCAN of the queue's
        queue = queue_url(settings)     # server, left to the roles that use it anyway
    metrics = RoleMetrics(role, run=settings.run, redis_url=settings.redis_url,
                          redis_options=redis_options(settings), queue_url=queue,
                          queue_options=queue_options(settings) if queue else None)
    metrics.add_gauge("rollq_event_loop_lag_seconds", "p99 event-loop lag over the recent "
                      "window", lambda: lag.snapshot().p99_ms / 1000)
    for register in extra:
        register(metrics)
    port = await asyncio.to_thread(metrics.serve, settings.metrics_port)
    log.info("metrics_serving", role=role, port=port)
    try:
        yield
    finally:
        await asyncio.to_thread(metrics.close)


async def own_pending(reader: StreamReader, stage: Stage) -> None:
    """Process the entries this consumer holds unacked (left by an outage or a crash)."""
    pending = await reader.read_own_pending(count=10_000)
    if pending:
        await stage.process(pending)


def env_factory(name: str, options: dict[str, object]) -> Callable[[], Env]:
    make_env(name, **options)  # fail at start-up, with the choices, on a bad name
    return lambda: make_env(name, **options)


async def run_workers(settings: WorkerSettings, *, burst: bool = False,
                      transport: object = None) -> None:
    """Run an arq worker pool for the run's rollout jobs.

    SIGINT/SIGTERM stop it gracefully: no new job is taken, jobs in hand get the grace
    period to finish, and the rest are cancelled, which puts them back in the queue (arq
    re-runs a cancelled job). A Redis outage is ridden out, each server on its own
    (``ops.watching``: the queue's and the data plane's): the pool starts polling again once
    the server that failed answers; a stop during the outage ends it at once.
    """
    extra = dict(settings.sampling_options)
    typed = {key: extra.pop(key) for key in ("top_k", "seed", "stop") if key in extra}
    if isinstance(typed.get("stop"), str):
        typed["stop"] = [typed["stop"]]
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                              max_tokens=settings.max_tokens, extra=extra, **typed)
    worker = build_worker(
        redis_url=queue_url(settings), run=settings.run,
        env_factory=env_factory(settings.env, settings.env_options),
        inference_urls=settings.inference, model=settings.model or None, sampling=sampling,
        open_data=lambda: open_redis(settings),
        group_size=settings.group_size, concurrency=settings.concurrency,
        job_timeout_s=settings.job_timeout_s, max_tries=settings.max_tries,
        request_timeout_s=settings.request_timeout_s, partitions=settings.partitions,
        result_ttl_s=settings.job_result_ttl_s, redis_options=queue_options(settings),
        max_entry_bytes=settings.max_entry_bytes, logprobs_mode=settings.logprobs_mode,
        lora_name=settings.lora_name,
        grace_s=settings.grace_s,
        burst=burst, transport=transport, on_refused=lambda exc: refuse(exc),
    )
    stopping = asyncio.Event()
    refused: list[ConfigError] = []

    def refuse(exc: ConfigError) -> None:  # a job met a setting to fix: stop, then exit 78
        if not refused:
            refused.append(exc)
            _stop_worker(worker, stopping, signal.SIGTERM, reason="configuration_error")

    if not burst:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stop_worker, worker, stopping, sig)
    data = open_redis(settings, socket_connect_timeout=2)
    queue = open_queue_redis(settings, socket_connect_timeout=2)
    watched = [  # arq's loop polls the queue: its server first
        Watched(OutageRider(give_up_s=settings.redis_give_up_s, what="workers", log=log,
                            stop=stopping, connection="queue"),
                probe_command(queue, "ZCARD", queue_name(settings.run))),
        Watched(OutageRider(give_up_s=settings.redis_give_up_s, what="workers", log=log,
                            stop=stopping, connection="data"),
                probe_command(data, "HGET", state_key(settings.run), PARTITIONS_FIELD)),
    ]
    try:
        for connection in watched:  # at start-up both must answer at once (exit 69 otherwise)
            await connection.probe()
        existed = await warn_if_unknown(data, settings.run, "workers")
        async with waiting_for_inference(queue, settings.run):
            checked = await _inference_checked(settings, stopping, transport)
        if not checked:
            log.info("workers_stopped", jobs_complete=0, jobs_retried=0)
            return
        async with LoopLagMonitor("workers") as lag, serve_metrics(
                settings, "workers", lag,
                worker_metrics(worker, settings.concurrency, settings.inference)), watching(
                    RunWatchdog(data, settings.run, "workers",
                                stall_s=settings.stall_warning_s, existed=existed)):
            while True:
                try:
                    await worker.async_run()
                    return  # a burst emptied the queue
                except asyncio.CancelledError:
                    if stopping.is_set():
                        log.info("workers_stopped", jobs_complete=worker.jobs_complete,
                                 jobs_retried=worker.jobs_retried)
                        if refused:
                            raise refused[0] from None
                        return
                    raise
                except REFUSALS as exc:  # before ConnectionError: AuthenticationError is one
                    raise access_refused(exc, user=urlsplit(queue_url(settings)).username
                                         ) from exc
                except (BrokerUnavailable, redis_errors.ConnectionError,
                        redis_errors.TimeoutError, redis_errors.WatchError, OSError) as exc:
                    # WatchError: arq's job pick-up WATCHes keys, and redis-py reports a
                    # connection lost during that WATCH as one
                    try:
                        await ride_out(exc if isinstance(exc, BrokerUnavailable) else
                                       BrokerUnavailable(f"redis unavailable: {exc!r}"), watched)
                    except StoppedDuringOutage:
                        await _finish_jobs_in_hand(worker, settings.grace_s)
                        log.info("workers_stopped", jobs_complete=worker.jobs_complete,
                                 jobs_retried=worker.jobs_retried, during_outage=True)
                        return
    finally:
        try:
            await close_worker(worker)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
            pass  # Redis is away: the jobs in hand are still in arq's queue
        await data.aclose()
        await queue.aclose()


async def _inference_checked(settings: WorkerSettings, stopping: asyncio.Event,
                             transport: object) -> bool:
    """Check that the servers serve ``--model`` before any job is taken
    (``producers.inference.served``: ``ConfigError``, exit 78, when not); False when a stop
    signal came while the check waited for a server to answer."""
    checking = asyncio.create_task(check_served(
        settings.inference, settings.model or None,
        transport=transport))  # type: ignore[arg-type]  # an httpx transport, from tests
    stopped = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({checking, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not checking.done():
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking
    if checking.cancelled():
        return False
    checking.result()  # raises the check's ConfigError
    return True


async def _finish_jobs_in_hand(worker: Any, grace_s: float) -> None:
    """A stop during an outage: the jobs in hand get the grace period, as in any stop (the
    rest are cancelled by ``worker.close``, which leaves them in arq's queue)."""
    running = [task for task in worker.tasks.values() if not task.done()]
    if running:
        await asyncio.wait(running, timeout=grace_s)


def _stop_worker(worker: Any, stopping: asyncio.Event, sig: signal.Signals,
                 reason: str | None = None) -> None:
    if stopping.is_set():
        return
    stopping.set()
    log.info("workers_stopping", **({"signal": sig.name} if reason is None else
                                    {"reason": reason}))
    worker.handle_sig_wait_for_completion(sig)


async def run_feeder(settings: FeederSettings, stop: asyncio.Event) -> None:
    """Admit rollout jobs until every epoch is admitted or ``stop`` is set."""
    env = make_env(settings.env, **settings.env_options)
    redis = open_redis(settings)
    queue = await connect_queue(queue_url(settings), queue_options(settings))
    try:
        await _partitions(redis, settings.run, settings.partitions)
        await record_seed(redis, settings.run, settings.shuffle_seed)
        plan = FeedPlan(dataset_size=len(env), epochs=settings.epochs,
                        max_staleness=settings.max_staleness, batch_groups=settings.batch_groups)
        await record_plan(redis, settings.run, plan)

        async def enqueue(position: int) -> bool:
            return await enqueue_rollout(queue, settings.run, env.name, position,
                                         items=len(env))

        async def requeue(env_name: str, position: int) -> bool:
            return await requeue_rollout(queue, settings.run, env_name, position)

        log.info("feeder_started", run=settings.run, env=env.name, items=len(env),
                 epochs=settings.epochs)
        rider = OutageRider(give_up_s=settings.redis_give_up_s, what="feeder", log=log,
                            stop=stop)
        feeder = Feeder(redis, settings.run, plan, enqueue, requeue=requeue,
                        trip_after=settings.breaker_failures)
        startup_done()
        async with LoopLagMonitor("feeder") as lag, serve_metrics(
                settings, "feeder", lag, feeder_metrics(feeder)), watching(RunWatchdog(
                    redis, settings.run, "feeder", stall_s=settings.stall_warning_s,
                    feeder=feeder)):
            await feeder.run_until(stop, settings.poll_s, rider)
    finally:
        await queue.aclose()
        await redis.aclose()


def print_progress(line: str) -> None:
    print(f"\r{line}", end="", file=sys.stderr, flush=True)
