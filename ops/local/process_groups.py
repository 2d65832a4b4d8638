"""Stopping a child process started in its own session, with everything it forked.

rollq's child processes (the local stack's redis-server and vLLM, the local Redis
Cluster's nodes, the tests' and benchmarks' API servers) are started with
``start_new_session=True``, so the child leads a process group that also holds what it
forks (vLLM's EngineCore, say). Signalling that group, not the pid alone, leaves nothing
behind: ``stop_group`` asks politely (SIGTERM, then SIGKILL after a grace period),
``kill_group`` does what a crash would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
