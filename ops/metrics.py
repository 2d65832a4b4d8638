"""Prometheus metrics: every long-running role serves ``/metrics`` with ``--metrics-port``.

Needs the ``metrics`` extra (``prometheus_client``); the core never imports it. Two kinds of
series, named by Prometheus conventions (``rollq_…_total`` counters, ``_seconds``):

- **Run-wide**, read from Redis at scrape time by ``RunCollector``: the run's own counters
  (exact across every process: they change in the same Lua call as the acks they count),
  stream lengths, consumer-group lag and pending entries, groups in flight, the policy
  version and recent rewards per component. Every role serves them, labelled with ``run``;
  dashboards take ``max by (run, …)`` across instances.
- **This process's own**: ``rollq_role_info``, its event-loop lag, what it did through
  ``add_gauge``/``add_counter``/``add_histogram`` callbacks (``ops.role_metrics`` wires each
  role: scorer outcomes, worker jobs and inference per server, the feeder's admission
  budget, the trainer SDK's steps and staleness), and the process' CPU and memory
  (``prometheus_client``'s process collector).
- **The workers' health**, run-wide from arq's health records on the control plane
  (``ops.health``): worker processes alive, jobs running and queued.

Scrapes read Redis with a blocking client in the exporter's thread, never on the role's
event loop; a scrape while Redis is away reports ``rollq_redis_up 0`` instead of failing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from rollq.ops.connections import CLUSTER_SCHEMES
from rollq.ops.health import read_health_sync
from rollq.schemas import ConfigError, DecodeError, scored_rewards
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    CONSUMED_COUNTER,
    DROP_PREFIX,
    PARTITIONS_FIELD,
    POLICY_VERSION_FIELD,
    SCORED_COUNTER,
    counters_key,
    state_key,
    stream_key,
    sum_counters,
)
from rollq.schemas.stats import Histogram

try:  # the `metrics` extra
    import prometheus_client
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError:  # pragma: no cover - exercised only without the extra
    prometheus_client = None  # type: ignore[assignment]

REWARD_WINDOW = 64
"""Scored entries (per partition) the reward gauges average over."""


def _require() -> None:
    if prometheus_client is None:
        raise ConfigError("--metrics-port needs prometheus_client: pip install 'rollq[metrics]'")


class RunCollector:
    """Run-wide series read from Redis at each scrape (see the module doc)."""

    def __init__(self, redis_url: str, run: str,
                 redis_options: dict[str, Any] | None = None, *,
                 queue_url: str | None = None,
                 queue_options: dict[str, Any] | None = None) -> None:
        self.run = run
        self._connect = (redis_url, redis_options)
        self._connect_queue = None if queue_url is None else (queue_url, queue_options)
        # Any: redis-py types every command as `Awaitable[T] | T`, sync client or not.
        # Made at the first scrape: a cluster client connects when made.
        self.client: Any = None
        self.queue: Any = None

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("rollq_redis_up", "1 when the last scrape could read Redis",
                               labels=["run"])
        try:
            if self.client is None:
                self.client = _sync_client(*self._connect)
            if self.queue is None and self._connect_queue is not None:
                self.queue = _sync_client(*self._connect_queue)
            families = list(self._families())
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException, OSError):
            up.add_metric([self.run], 0.0)
            yield up
            return
        up.add_metric([self.run], 1.0)
        yield up
        yield from families

    def _families(self) -> Iterator[Any]:
        run = self.run
        state = self.client.hgetall(state_key(run))
        partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
        counters = sum_counters(self.client.hgetall(counters_key(run, p))
                                for p in range(partitions))
        admitted = int(state.get(ADMITTED_FIELD.encode(), b"0"))
        totals = CounterMetricFamily("rollq_groups", "Groups by what happened to them "
                                     "(admitted, scored, consumed)", labels=["run", "stage"])
        totals.add_metric([run, "admitted"], admitted)
        totals.add_metric([run, "scored"], counters.get(SCORED_COUNTER, 0))
        totals.add_metric([run, "consumed"], counters.get(CONSUMED_COUNTER, 0))
        yield totals
        dropped = CounterMetricFamily("rollq_groups_dropped", "Groups dead-lettered or dropped, "
                                      "by reason (currently: requeues subtract)",
                                      labels=["run", "reason"])
        skipped = CounterMetricFamily("rollq_reward_components_skipped", "Reward component "
                                      "calls skipped under on_error: skip_component",
                                      labels=["run", "component", "reason"])
        freed = 0
        for name, value in sorted(counters.items()):
            if name.startswith(DROP_PREFIX):
                reason = name[len(DROP_PREFIX):]
                dropped.add_metric([run, reason], value)
                freed += value if reason != "duplicate" else 0
            elif name.startswith("flag:"):
                _, component, reason = [*name.split(":", 2), "", ""][:3]
                skipped.add_metric([run, component, reason], value)
        yield dropped
        yield skipped
        requeued = CounterMetricFamily("rollq_dead_letters_requeued", "Dead letters requeued",
                                       labels=["run"])
        requeued.add_metric([run], counters.get("requeued", 0))
        yield requeued
        gauges = GaugeMetricFamily("rollq_groups_in_flight", "Admitted groups not yet consumed "
                                   "or dropped (admission counts these)", labels=["run"])
        gauges.add_metric([run], max(0, admitted - counters.get(CONSUMED_COUNTER, 0) - freed))
        yield gauges
        version = GaugeMetricFamily("rollq_policy_version", "The trainer's published step",
                                    labels=["run"])
        version.add_metric([run], int(state.get(POLICY_VERSION_FIELD.encode(), b"0")))
        yield version
        yield from self._streams(partitions)
        yield from self._rewards(partitions)
        if self.queue is not None:
            yield from self._workers()

    def _workers(self) -> Iterator[Any]:
        health = read_health_sync(self.queue, self.run)
        alive = GaugeMetricFamily("rollq_workers_alive", "Worker processes whose arq health "
                                  "record is fresh (refreshed every 10 s)", labels=["run"])
        alive.add_metric([self.run], health.alive)
        jobs = GaugeMetricFamily("rollq_workers_jobs", "Rollout jobs by state, from the live "
                                 "workers' health records", labels=["run", "state"])
        jobs.add_metric([self.run, "running"], health.running)
        jobs.add_metric([self.run, "queued"], health.queued)
        yield alive
        yield jobs

    def _streams(self, partitions: int) -> Iterator[Any]:
        run = self.run
        length = GaugeMetricFamily("rollq_stream_entries", "Entries in a stream",
                                   labels=["run", "stream", "partition"])
        lag = GaugeMetricFamily("rollq_consumer_group_lag", "Entries not yet delivered to a "
                                "consumer group", labels=["run", "stream", "group"])
        pending = GaugeMetricFamily("rollq_consumer_group_pending", "Entries delivered and not "
                                    "acked", labels=["run", "stream", "group"])
        consumers = GaugeMetricFamily("rollq_consumer_group_consumers", "Consumers registered "
                                      "in a group", labels=["run", "stream", "group"])
        summed: dict[tuple[str, str], list[int]] = {}
        for p in range(partitions):
            for name in ("traj", "scored", "dead"):
                key = stream_key(run, p, name)
                if not self.client.exists(key):
                    continue
                length.add_metric([run, name, str(p)], int(self.client.xlen(key)))
                for group in self.client.xinfo_groups(key):
                    sums = summed.setdefault((name, group["name"].decode()), [0, 0, 0])
                    sums[0] += int(group.get("lag") or 0)
                    sums[1] += int(group["pending"])
                    sums[2] += int(group["consumers"])
        for (name, group), (lagging, held, count) in sorted(summed.items()):
            lag.add_metric([run, name, group], lagging)
            pending.add_metric([run, name, group], held)
            consumers.add_metric([run, name, group], count)
        yield from (length, lag, pending, consumers)

    def _rewards(self, partitions: int) -> Iterator[Any]:
        rewards: list[float] = []
        components: dict[str, list[float]] = {}
        for p in range(partitions):
            for _, fields in self.client.xrevrange(stream_key(self.run, p, "scored"),
                                                   count=REWARD_WINDOW):
                try:
                    rewards += scored_rewards(fields)
                    meta = orjson.loads(fields[b"score_meta"])
                except (DecodeError, KeyError, orjson.JSONDecodeError):
                    continue
                for per_sequence in meta.get("components", []):
                    for name, value in per_sequence.items():
                        if isinstance(value, int | float):
                            components.setdefault(name, []).append(float(value))
        mean = GaugeMetricFamily("rollq_reward_mean", "Mean total reward of the recent scored "
                                 "completions", labels=["run"])
        if rewards:
            mean.add_metric([self.run], sum(rewards) / len(rewards))
        yield mean
        per = GaugeMetricFamily("rollq_reward_component_mean", "Mean raw value of each reward "
                                "component over the recent scored completions",
                                labels=["run", "component"])
        for name, values in sorted(components.items()):
            per.add_metric([self.run, name], sum(values) / len(values))
        yield per


def _sync_client(url: str, options: dict[str, Any] | None) -> Any:
    """A blocking client for ``url``; a ``RedisCluster`` for rollq's cluster schemes."""
    options = {"socket_timeout": 5, "socket_connect_timeout": 2, **(options or {})}
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        return RedisCluster.from_url(CLUSTER_SCHEMES[scheme] + url[len(scheme):], **options)
    return redis.Redis.from_url(url, **options)


class _Callbacks:
    """Process-local series whose values come from callbacks at scrape time."""

    def __init__(self, role: str, run: str) -> None:
        self.role, self.run = role, run
        self.gauges: list[tuple[str, str, dict[str, str], Callable[[], float]]] = []
        self.counters: list[tuple[str, str, dict[str, str], Callable[[], float]]] = []
        self.histograms: list[tuple[str, str, dict[str, str], Callable[[], Histogram]]] = []

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily("rollq_role_info", "The role this process runs",
                                 labels=["run", "role"])
        info.add_metric([self.run, self.role], 1.0)
        yield info
        for kind, entries in (("gauge", self.gauges), ("counter", self.counters)):
            families: dict[str, Any] = {}
            for name, documentation, labels, read in entries:
                family = families.get(name)
                if family is None:
                    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    family = families[name] = cls(name, documentation,
                                                  labels=["run", "role", *labels])
                family.add_metric([self.run, self.role, *labels.values()], float(read()))
            yield from families.values()
        histograms: dict[str, Any] = {}
        for name, documentation, labels, observed in self.histograms:
            family = histograms.get(name)
            if family is None:
                family = histograms[name] = HistogramMetricFamily(
                    name, documentation, labels=["run", "role", *labels])
            histogram = observed()
            family.add_metric([self.run, self.role, *labels.values()],
                              histogram.cumulative(), histogram.sum)
        yield from histograms.values()


class RoleMetrics:
    """The ``/metrics`` endpoint of one role process (``serve`` starts it)."""

    def __init__(self, role: str, *, run: str, redis_url: str | None,
                 redis_options: dict[str, Any] | None = None, queue_url: str | None = None,
                 queue_options: dict[str, Any] | None = None) -> None:
        """``redis_url`` None: no run-wide series (a role without Redis: the gateway);
        ``queue_url``: the control plane, for the workers' health series."""
        _require()
        self.registry = CollectorRegistry(auto_describe=False)
        self._callbacks = _Callbacks(role, run)
        self.registry.register(self._callbacks)
        if redis_url is not None:
            self.registry.register(RunCollector(redis_url, run, redis_options,
                                                queue_url=queue_url,
                                                queue_options=queue_options))
        prometheus_client.ProcessCollector(registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def add_gauge(self, name: str, documentation: str, read: Callable[[], float],
                  **labels: str) -> None:
        self._callbacks.gauges.append((name, documentation, labels, read))

    def add_counter(self, name: str, documentation: str, read: Callable[[], float],
                    **labels: str) -> None:
        """``name`` without ``_total`` (the exposition adds it)."""
        self._callbacks.counters.append((name, documentation, labels, read))

    def add_histogram(self, name: str, documentation: str, read: Callable[[], Histogram],
                      **labels: str) -> None:
        """``name`` without ``_bucket``/``_sum``/``_count`` (the exposition adds them)."""
        self._callbacks.histograms.append((name, documentation, labels, read))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` in a background thread; returns the port (0: a free one).
        ``ConfigError`` naming the port when it cannot be had (in use, say)."""
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: "
                              f"{exc.strerror or exc} (set another --metrics-port)") from None
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return bytes(prometheus_client.generate_latest(self.registry))


__all__ = ["Collector", "RoleMetrics", "RunCollector"]
