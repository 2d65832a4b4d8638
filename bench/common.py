"""Helpers shared by the benchmarks: a throwaway redis-server, medians, a result table, and
one OS process per role.

The benchmarks depend on nothing under ``tests/``: they start their own redis-server on a
free loopback port, persistence off (no RDB snapshots, no AOF), in a temporary directory
that is removed when it stops.
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis

from rollq.ops.local.stack import RedisProcess, free_port
from rollq.schemas.heap import freeze_heap

__all__ = ["BenchRedis", "fmt", "free_port", "median_of", "payload_bytes", "print_table",
           "redis_cpu", "report_ready", "report_role", "run_role_processes"]


class BenchRedis(RedisProcess):
    """The embedded redis-server (``ops.local.stack``) in a temporary directory, persistence off;
    use as a context manager."""

    def __init__(self, binary: str | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="rollq-bench-redis-")
        super().__init__(Path(self._dir.name), binary=binary)

    def stop(self) -> None:
        super().stop()
        self._dir.cleanup()

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout
        for word in out.split():
            if word.startswith("v="):
                return word[2:]
        return out.strip()

    def __enter__(self) -> BenchRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def redis_cpu(url: str) -> float:
    """redis-server's CPU seconds so far (user + sys, all threads)."""
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("cpu")
    finally:
        await client.aclose()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def payload_bytes(fields: dict[bytes, bytes]) -> int:
    """Bytes of a stream entry's field names and values."""
    return sum(len(k) + len(v) for k, v in fields.items())


def median_of(runs: Iterable[float]) -> float:
    """The median of a benchmark's per-run figures."""
    values = list(runs)
    if not values:
        raise ValueError("median_of() needs at least one run")
    return float(statistics.median(values))


def fmt(value: Any, digits: int = 1) -> str:
    """A number for a table cell: fixed decimals for floats, thousands separators for ints."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "") -> None:
    """Print rows under headers, columns right-aligned (the first left-aligned)."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    if title:
        print(title)
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    print()


def report_ready(messages: Any, role: str) -> None:
    """Tell the parent that ``role`` is set up, once what set-up built is frozen out of the
    cyclic collector's walks (``gc.freeze``), as the ``rollq`` program's roles do
    (``schemas.heap``) and a training script does after building its model. Every role, raw
    ones included, gets the same."""
    freeze_heap()
    messages.put(("ready", role, None))


def run_role_processes(entry: Callable[[Any, Any, Any], None], jobs: Sequence[Any],
                       silence_s: float = 300.0) -> dict[str, dict[str, float]]:
    """Run each job in its own spawned OS process and return their reports by role.

    ``entry(job, messages, start)`` runs in the child: it sets up, puts
    ``("ready", role, None)``, waits for ``start`` (so every process starts measuring at
    once, after all set-ups), runs, and puts ``("done", role, report)`` or
    ``("error", role, traceback)``. ``job.role`` names each job.
    """
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    start = context.Event()
    processes = [context.Process(target=entry, args=(job, messages, start), daemon=True)
                 for job in jobs]
    for process in processes:
        process.start()
    try:
        ready = 0
        reports: dict[str, dict[str, float]] = {}
        while len(reports) < len(jobs):
            try:
                kind, role, data = messages.get(timeout=silence_s)
            except queue.Empty:
                raise RuntimeError(f"a role process went silent for {silence_s:.0f} s") from None
            if kind == "error":
                raise RuntimeError(f"role {role} failed:\n{data}")
            if kind == "ready":
                ready += 1
                if ready == len(jobs):
                    start.set()
            else:
                reports[role] = data
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    return reports


def report_role(role: str, messages: Any, run: Callable[[], dict[str, float]]) -> None:
    """The child side of ``run_role_processes``: ``run()`` the role and put
    ``("done", role, report)``, or ``("error", role, traceback)`` if it raised."""
    try:
        messages.put(("done", role, run()))
    except BaseException:
        messages.put(("error", role, traceback.format_exc()))
