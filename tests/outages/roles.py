"""Running a ``rollq`` role as a process the way an operator does, and reading its lines.

``RoleProcess.start(...)`` runs ``python -m rollq <role> …`` with JSON logs; ``wait_for``
reads its stderr until a line with an event appears (every line read is kept in ``lines``),
``finish`` waits for the exit and returns the exit code and how long that took.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

QUICK_REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
                "advantages: {zero_variance: keep}\n")
"""A reward config that needs no gold answer and no pool process."""


@dataclass
class RoleProcess:
    process: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    async def start(cls, *argv: str, **environ: str) -> RoleProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollq", *argv,
            env={**os.environ, "ROLLQ_LOG_FORMAT": "json", **environ},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(process)

    async def wait_for(self, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The first line (from now on, or read before) whose ``event`` is ``event``."""
        for line in self.lines:
            if line.get("event") == event:
                return line
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = await self._read_line(deadline - time.monotonic())
            if line is None:
                break
            if line.get("event") == event:
                return line
        pytest.fail(f"no {event!r} line; the role wrote: {self.lines[-20:]}")

    async def _read_line(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.process.stderr is not None
        try:
            raw = await asyncio.wait_for(self.process.stderr.readline(), max(timeout_s, 0.01))
        except TimeoutError:
            return None
        if not raw:
            return None
        try:
            line = json.loads(raw)
        except ValueError:
            line = {"event": None, "text": raw.decode(errors="replace")}
        self.lines.append(line)
        return line

    async def first_output(self, timeout_s: float = 60.0) -> str:
        """The first line the role printed on stdout (``status``)."""
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        return raw.decode(errors="replace")

    def signal(self, sig: signal.Signals) -> float:
        """Send ``sig``; returns the monotonic time it was sent."""
        self.process.send_signal(sig)
        return time.monotonic()

    async def finish(self, timeout_s: float) -> int:
        """The exit code, once the process has exited (killed and failed after
        ``timeout_s``); reads the rest of its stderr into ``lines``."""
        try:
            code = await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            pytest.fail(f"still running {timeout_s} s later; it wrote: {self.lines[-20:]}")
        while await self._read_line(5.0) is not None:
            pass
        return code

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
