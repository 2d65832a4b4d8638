"""Stopping a child process started in its own session, with everything it forked.

rollq's child processes (the local stack's redis-server and vLLM, the local Redis
Cluster's nodes, the tests' and benchmarks' API servers) are started with
``start_new_session=True``, so the child leads a process group that also holds what it
forks (vLLM's EngineCore, say). Signalling that group, not the pid alone, leaves nothing
behind: ``stop_group`` asks politely (SIGTERM, then SIGKILL after a grace period),
``kill_group`` does what a crash would. ``Processes`` keeps a set of such children with
their logs (the demo's roles), checks that none died, and stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM ``process``'s group and wait up to ``grace_s`` for it; then SIGKILL it.
    A process that already exited is left alone."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill_group(process)
    except ProcessLookupError:
        pass


def kill_group(process: subprocess.Popen[bytes], wait_s: float = 5.0) -> None:
    """SIGKILL ``process``'s group, as a crash would, and reap the process."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=wait_s)


class Processes:
    """Child processes in their own process groups, stopped in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.started.append((name, process))
        return process

    def check(self) -> None:
        for name, process in self.started:
            if process.poll() not in (None, 0):
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")

    def stop(self, grace_s: float = 20.0) -> None:
        for _, process in reversed(self.started):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, process in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
