"""What each role adds to its ``/metrics`` (``ops.metrics.RoleMetrics``) besides the
run-wide series: each ``*_metrics`` returns a function that registers the role's own
series, read from the role's objects at scrape time.

Series (labels ``run`` and ``role`` on every one):

- workers: ``rollq_worker_jobs_total{outcome=complete|failed|retried}`` (arq's counts of
  this process; a dead-lettered job *completes*), ``rollq_worker_groups_total{outcome=
  published|dead_lettered}``, ``rollq_worker_jobs_running``, ``rollq_worker_job_slots``,
  and per inference server (label ``server``): ``rollq_inference_request_seconds``
  (histogram of successful generation requests), ``rollq_inference_completion_tokens_total``
  (tokens/s: its rate), ``rollq_inference_failures_total``,
  ``rollq_inference_outstanding_requests``, ``rollq_inference_server_up`` (healthy and not
  paused);
- feeder: ``rollq_feeder_jobs_admitted_total``, ``rollq_admission_budget`` and
  ``rollq_admission_outstanding`` (at its last check), ``rollq_feeder_cursor``,
  ``rollq_feeder_positions``;
- trainer SDK (``serve_trainer_metrics``): ``rollq_trainer_batches_total``,
  ``rollq_trainer_groups_total``, ``rollq_trainer_groups_consumed_total``,
  ``rollq_trainer_tokens_total``, ``rollq_trainer_step_seconds``,
  ``rollq_trainer_wait_seconds``, ``rollq_trainer_staleness_versions`` (histograms);
- the gateway: the inference series above, ``rollq_gateway_episodes`` (open now) and
  ``rollq_gateway_episodes_total{outcome=opened|closed|expired}``; with ``--sessions``
  ``rollq_gateway_session_events_total{outcome=opened|refused|closed|published|expired|
  dead_lettered|replayed}`` and the run-wide series (``session_expired`` among the drops).

The HTTP roles (the Atropos API, the gateway) answer ``GET /metrics`` on their own port
(``add_metrics_route``); the others serve it with ``--metrics-port``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollq.consumers.trainer import SyncTrainerClient
from rollq.producers.inference import InferencePool
from rollq.producers.worker import DEAD_LETTERED, OUTCOMES, PUBLISHED
from rollq.schemas import ConfigError
from rollq.schemas.stats import Histogram

if TYPE_CHECKING:
    from arq.worker import Worker
    from fastapi import FastAPI

    from rollq.consumers.trainer import TrainerClient
    from rollq.ops.metrics import RoleMetrics
    from rollq.producers.feeder import Feeder
    from rollq.producers.inference.capture import CaptureHub
    from rollq.producers.inference.server import InferenceServer
    from rollq.producers.sessions import SessionHost

Register = Callable[["RoleMetrics"], None]


def pool_metrics(pool: Callable[[], InferencePool | None], urls: Sequence[str]) -> Register:
    """Per-server series of an inference pool (``pool()``: None until it is opened)."""

    def register(metrics: RoleMetrics) -> None:
        for url in (u.rstrip("/") for u in urls):
            def server(url: str = url) -> InferenceServer | None:
                opened = pool()
                return next((s for s in opened.servers if s.base_url == url), None) \
                    if opened is not None else None

            def read(attr: str, server: Callable[[], Any] = server) -> Callable[[], float]:
                return lambda: float(getattr(server(), attr, 0))

            metrics.add_histogram(
                "rollq_inference_request_seconds", "Seconds of successful generation "
                "requests, per server", lambda s=server: getattr(s(), "latency", Histogram()),
                server=url)
            metrics.add_counter("rollq_inference_completion_tokens", "Tokens generated, per "
                                "server (its rate is tokens/s)", read("completion_tokens"),
                                server=url)
            metrics.add_counter("rollq_inference_failures", "Requests that found the server "
                                "unavailable (each retry counts)", read("failures"), server=url)
            metrics.add_gauge("rollq_inference_outstanding_requests", "Requests in flight, "
                              "per server", read("outstanding"), server=url)
            metrics.add_gauge("rollq_inference_server_up", "1 while the server is healthy "
                              "and not paused", lambda s=server: float(
                                  s() is not None and s().healthy and not s().paused),
                              server=url)

    return register


def worker_metrics(worker: Worker, concurrency: int, urls: Sequence[str]) -> Register:
    """An arq worker pool's jobs and its inference pool (made in the worker's start-up)."""

    def register(metrics: RoleMetrics) -> None:
        for outcome in ("complete", "failed", "retried"):
            metrics.add_counter("rollq_worker_jobs", "Rollout job tries of this process by "
                                "how they ended (arq's counts: a dead-lettered job completes)",
                                lambda outcome=outcome: getattr(worker, f"jobs_{outcome}"),
                                outcome=outcome)
        for outcome, key in (("published", PUBLISHED), ("dead_lettered", DEAD_LETTERED)):
            metrics.add_counter("rollq_worker_groups", "Jobs of this process that ended in a "
                                "published group or a dead letter",
                                lambda key=key: worker.ctx.get(OUTCOMES, {}).get(key, 0),
                                outcome=outcome)
        metrics.add_gauge("rollq_worker_jobs_running", "Jobs this process runs now",
                          lambda: sum(not task.done() for task in list(worker.tasks.values())))
        metrics.add_gauge("rollq_worker_job_slots", "Jobs this process may run at once",
                          lambda: concurrency)
        pool_metrics(lambda: worker.ctx.get("inference"), urls)(metrics)

    return register


def feeder_metrics(feeder: Feeder) -> Register:
    """A feeder's admissions and the admission rule's last verdict."""

    def register(metrics: RoleMetrics) -> None:
        def state(attr: str) -> Callable[[], float]:
            return lambda: float(getattr(feeder.last_state, attr, 0))

        metrics.add_counter("rollq_feeder_jobs_admitted", "Rollout jobs this feeder admitted",
                            lambda: feeder.admitted)
        metrics.add_gauge("rollq_admission_budget", "Jobs the admission rule allowed at this "
                          "feeder's last check (0: generation is max_staleness versions ahead "
                          "of the trainer, or the epochs are all admitted)",
                          lambda: feeder.last_budget)
        metrics.add_gauge("rollq_admission_outstanding", "Admitted groups not yet consumed or "
                          "dropped (in flight + buffered), at the last check",
                          state("outstanding"))
        metrics.add_gauge("rollq_feeder_cursor", "Dataset positions admitted (epoch x items "
                          "+ item), at the last check", state("cursor"))
        metrics.add_gauge("rollq_feeder_positions", "Positions of all epochs: where the "
                          "cursor ends", lambda: feeder.plan.total)

    return register


def trainer_metrics(client: TrainerClient) -> Register:
    """A trainer SDK client's batches, steps and the staleness of what it trained on."""
    stats = client.stats

    def register(metrics: RoleMetrics) -> None:
        metrics.add_counter("rollq_trainer_batches", "Batches acked", lambda: stats.batches)
        metrics.add_counter("rollq_trainer_groups", "Groups in acked batches (replays after "
                            "a resume included)", lambda: stats.groups)
        metrics.add_counter("rollq_trainer_groups_consumed", "Entries this trainer's acks "
                            "counted consumed", lambda: stats.consumed)
        metrics.add_counter("rollq_trainer_tokens", "Prompt + completion tokens of acked "
                            "groups", lambda: stats.tokens)
        metrics.add_histogram("rollq_trainer_step_seconds", "From next_batch returning a "
                              "batch to its ack: the training step", lambda: stats.step_seconds)
        metrics.add_histogram("rollq_trainer_wait_seconds", "Time inside next_batch per batch "
                              "(waiting for groups)", lambda: stats.wait_seconds)
        metrics.add_histogram("rollq_trainer_staleness_versions", "Policy versions between "
                              "each trained group and the trainer's version at next_batch",
                              lambda: stats.staleness)
        for method in stats.sync_seconds:
            metrics.add_histogram("rollq_trainer_weight_sync_seconds", "Each successful weight "
                                  "sync (publish_policy), by method",
                                  lambda method=method: stats.sync_seconds[method],
                                  method=method)
            metrics.add_histogram("rollq_trainer_weight_sync_paused_seconds", "How long each "
                                  "weight sync paused generation, by method",
                                  lambda method=method: stats.paused_seconds[method],
                                  method=method)
            metrics.add_counter("rollq_trainer_weight_sync_bytes", "Weight bytes the trainer "
                                "sent to the servers, by method",
                                lambda method=method: stats.sync_bytes[method], method=method)
            metrics.add_histogram("rollq_trainer_weight_sync_aborted_requests", "Requests the "
                                  "servers aborted during each weight sync, by method",
                                  lambda method=method: stats.sync_aborts[method],
                                  method=method)

    return register


def serve_trainer_metrics(client: TrainerClient | SyncTrainerClient, port: int, *,
                          redis_url: str | None = None,
                          redis_options: dict[str, Any] | None = None,
                          host: str = "0.0.0.0") -> tuple[RoleMetrics, int]:
    """Serve a trainer's ``/metrics`` (its own series, plus the run-wide ones when
    ``redis_url`` is given) from a background thread; returns the endpoint (``close()`` it)
    and the port (``port=0``: a free one). ``client``: the async or the sync client."""
    from rollq.ops.metrics import RoleMetrics

    if isinstance(client, SyncTrainerClient):
        client = client.client

    metrics = RoleMetrics("trainer", run=client.run, redis_url=redis_url,
                          redis_options=redis_options)
    trainer_metrics(client)(metrics)
    return metrics, metrics.serve(port, host)


def gateway_metrics(hub: Callable[[], CaptureHub | None], urls: Sequence[str]) -> Register:
    """The gateway's episodes and its inference pool (``hub()``: None before start-up)."""

    def register(metrics: RoleMetrics) -> None:
        metrics.add_gauge("rollq_gateway_episodes", "Episodes open now",
                          lambda: len(getattr(hub(), "episodes", ())))
        for outcome in ("opened", "closed", "expired"):
            metrics.add_counter("rollq_gateway_episodes", "Episodes by what happened to them",
                                lambda outcome=outcome: getattr(hub(), outcome, 0),
                                outcome=outcome)
        pool_metrics(lambda: getattr(getattr(hub(), "upstream", None), "pool", None),
                     urls)(metrics)

    return register


def session_metrics(host: Callable[[], SessionHost | None]) -> Register:
    """The gateway's external sessions (``host()``: None when ``--sessions`` is off)."""

    def register(metrics: RoleMetrics) -> None:
        for outcome in SESSION_OUTCOMES:
            metrics.add_counter(
                "rollq_gateway_session_events", "External session events of this process: "
                "groups opened, refused (429), published, expired, dead-lettered; sessions "
                "closed; calls replayed from the record",
                lambda outcome=outcome: getattr(getattr(host(), "counts", None), outcome, 0),
                outcome=outcome)

    return register


SESSION_OUTCOMES = ("opened", "refused", "closed", "published", "expired", "dead_lettered",
                    "replayed")


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def add_metrics_route(app: FastAPI, make: Callable[[], RoleMetrics]) -> None:
    """``GET /metrics`` on an HTTP role's own server. The endpoint is made at the first
    scrape (``make``), and rendered in a thread: the run-wide series read Redis with a
    blocking client. Without the ``metrics`` extra the route answers 501."""
    from fastapi import Response  # the HTTP roles' extra ('servers'): they alone call this

    made: list[RoleMetrics] = []

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        try:
            if not made:
                made.append(make())
        except ConfigError as exc:
            return Response(str(exc), status_code=501, media_type="text/plain")
        return Response(await asyncio.to_thread(made[0].render), media_type=PROMETHEUS_TEXT)
