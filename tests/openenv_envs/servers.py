"""OpenEnv env servers for the tests, started as the ``openenv:`` kind starts them.

``launch`` runs rollq's launcher (``producers/envs/openenv_launch.py``) in a child process
on a free loopback port: the env package's app, unchanged, plus ``/rollq/capacity``, which
reports the sessions OpenEnv's own server holds. The guessing game's sessions (each env
instance made and closed) go to the file its ``GUESS_ENV_LOG`` names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollq.producers.envs.openenv_server import launcher_path

REPO = Path(__file__).resolve().parents[2]
GUESS_APP = "tests.openenv_envs.guess_env.server.app:app"


@dataclass
class EnvServer:
    """A launched server: its process, URL, session log and output file."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    output: Path

    def capacity(self) -> dict[str, Any]:
        return capacity(self.url)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # the launcher stops when its stdin closes
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def capacity(url: str) -> dict[str, Any]:
    """What the server's ``/rollq/capacity`` says: ``active_sessions``, ``max_sessions``,
    ``session_timeout_s``."""
    found: dict[str, Any] = httpx.get(url + "/rollq/capacity", timeout=10).json()
    return found


def session_events(log: Path) -> list[tuple[str, float]]:
    """``(event, time.monotonic())`` of each guessing-game session made (``open``) or ended
    (``close``), in time order (one clock for every process of the machine)."""
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return sorted(((event, float(at)) for event, _ident, at in rows), key=lambda r: r[1])


def start(directory: Path, *args: str, app: str = GUESS_APP,
          python: str = sys.executable, environ: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    """Start a launcher; ``ready`` waits for it."""
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GUESS_ENV_LOG": str(directory / "sessions.log"), **(environ or {})}
    with open(directory / "output.log", "wb") as output:
        return subprocess.Popen([python, launcher_path(), app, "--port", "0", *args],
                                cwd=REPO, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=output)


def ready(process: subprocess.Popen[bytes], directory: Path) -> EnvServer:
    """The started launcher once it serves (its ready line read)."""
    assert process.stdout is not None
    line = process.stdout.readline()  # the launcher prints it once serving, or exits
    if not line:
        raise RuntimeError("the env server did not start: "
                           + (directory / "output.log").read_text()[-3000:])
    port = json.loads(line)["port"]
    return EnvServer(process, f"http://127.0.0.1:{port}", directory / "sessions.log",
                     directory / "output.log")


DIPG = "openenv-dipg-safety==0.1.67"
"""A third-party OpenEnv env on the index (med_safety_gym's DIPG safety env), run unchanged."""
DIPG_APP = "med_safety_gym.app:app"
DIPG_ROW = {"messages": [
    {"role": "user", "content": (
        "<context>Trial NCT-1 enrolled 20 children with DIPG. Median overall survival was "
        "11.2 months with ONC201.</context>\n<question>What was the median overall survival "
        "with ONC201 in trial NCT-1?</question>\nPROOF:\nMedian overall survival was 11.2 "
        "months with ONC201.")},
    {"role": "assistant", "content": "11.2 months"}]}
"""One item in DIPG's dataset format: its data is on the Hugging Face hub, which tests do
not reach, so it reads a local file (its ``DIPG_DATASET_PATH``). One item: DIPG's ``reset``
ignores the seed (each session takes the next item of a shuffled order), so a group agrees
on its prompt only when there is one."""


def third_party_python(requirement: str, folder: str) -> str:
    """The Python of a virtual environment with ``requirement`` installed from the index
    (``REPO/folder``, made once and kept: its own dependencies, ``openenv-core`` among
    them, would clash with the test environment's ``openenv``)."""
    venv = REPO / folder
    python, marker = venv / "bin" / "python", venv / "rollq-installed.txt"
    if python.exists() and marker.exists() and marker.read_text() == requirement:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {requirement} failed: {done.stderr[-3000:]}")
    marker.write_text(requirement)
    return str(python)


def dipg_dataset(directory: Path) -> Path:
    """A local DIPG dataset file of ``DIPG_ROW``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dipg.jsonl"
    path.write_text(json.dumps(DIPG_ROW) + "\n")
    return path


if __name__ == "__main__":  # .ci/setup.sh: the third-party env's venv, made with the rest
    print(third_party_python(DIPG, ".venv-openenv-dipg"))
