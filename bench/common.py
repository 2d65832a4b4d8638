"""Helpers shared by the benchmarks: a throwaway redis-server, medians and a result table.

The benchmarks depend on nothing under ``tests/``: they start their own redis-server on a
free loopback port, persistence off (no RDB snapshots, no AOF), in a temporary directory
that is removed when it stops.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BenchRedis:
    """A redis-server on a free loopback port with persistence off; use as a context manager.

    ``extra_args`` are appended to the command line (e.g. ``["--io-threads", "2"]``).
    """

    def __init__(self, extra_args: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (e.g. apt-get install redis-server)")
        self.binary = binary
        self.extra_args = list(extra_args)
        self.port = 0
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> BenchRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="rollq-bench-redis-")
        self.port = free_port()
        self._process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
                "--protected-mode", "no",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

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
