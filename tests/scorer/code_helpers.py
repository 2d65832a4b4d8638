"""What both halves of the `code` reward's tests (`test_code_reward.py` and
`test_code_sandbox.py`) share: the sandbox uids, the test settings and cases, the check that
a test leaves no process of those uids, no child and no run directory behind (`unharmed`,
autouse in a module that imports it), and the builders of a scored and of a bare sandboxed
run."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import pytest

from rollq.consumers.scorer.components.code import CodeExecution, CodeSettings
from rollq.consumers.scorer.sandbox import Sandbox, SandboxLimits
from tests.scorer.helpers import make_sample

UID = 65534
SPARE_UID = 65533
FAST: dict[str, Any] = {"wall_s": 2.0, "cpu_s": 2, "memory_mb": 128, "max_processes": 16,
                        "max_output_bytes": 64 << 10}
"""Test settings: short walls (≤ 2 s) and a tiny process limit."""

ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry.name}/status") as file:
                if any(line.split()[1] == str(uid) for line in file if line.startswith("Uid:")):
                    pids.append(int(entry.name))
    return pids


def _children() -> list[int]:
    """Our child processes, less multiprocessing's resource tracker (started with the
    first spawned pool worker, it lives as long as this process)."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    found: list[int] = []
    for task in os.scandir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"{task.path}/children") as file:
            found += [int(pid) for pid in file.read().split() if int(pid) != tracker]
    return found


def _run_directories() -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"rollq-code-{UID}-*"))


@pytest.fixture(autouse=True)
def unharmed() -> Iterator[None]:
    """Refuse to start when anything runs as the sandbox uids (their process budget is
    machine-wide); afterwards, nothing of theirs is left, no child of ours either, and no
    run directory."""
    if _processes_of(UID) or _processes_of(SPARE_UID):
        pytest.skip(f"processes of uid {UID}/{SPARE_UID} are running on this machine")
    before = set(_children())
    yield
    deadline = time.monotonic() + 5
    while (_processes_of(UID) or _processes_of(SPARE_UID)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _processes_of(UID) == [] and _processes_of(SPARE_UID) == []
    assert set(_children()) <= before
    assert _run_directories() == []


def code(**settings: Any) -> CodeExecution:
    return CodeExecution(CodeSettings(**{**FAST, **settings}))


def fenced(program: str) -> str:
    return f"<think>easy</think>Here it is:\n```python\n{program}\n```\n"


def score(program: str, tests: Any = None, **settings: Any) -> float | None:
    sample = make_sample(fenced(program), metadata={"tests": ADD if tests is None else tests})
    return code(**settings).score(sample, [])


def run(program: str, stdin: str | None = None, **limits: Any) -> Any:
    sandbox = Sandbox(limits=SandboxLimits(**{"wall_s": 2.0, "cpu_s": 2,
                                              "memory_bytes": 128 << 20, **limits}))
    return sandbox.run({"main.py": program}, stdin=stdin)
