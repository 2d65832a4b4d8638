"""Shared by the Atropos API tests: the app in-process and as a process, child processes,
and groups as envs post them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from rollq.ops.atropos.app import create_app
from rollq.ops.local.process_groups import kill_group, stop_group
from rollq.ops.settings import AtroposApiSettings
from tests.redis_server import free_port

REGISTRATION = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4,
                "max_token_len": 512, "checkpoint_dir": "/tmp/ckpt",
                "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 100}


def env_registration(name: str = "gsm8k", group_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {"max_token_length": 512, "desired_name": name, "weight": 1.0,
            "group_size": group_size, **extra}


def atropos_group(marker: int, size: int = 2, env_id: int | None = 0,
                  prompt: int = 3, completion: int = 4, **extra: Any) -> dict[str, Any]:
    """A group as atroposlib's env posts it: a shared masked prompt, then completions
    whose masks are the token ids (labels). ``marker`` is the first prompt token."""
    prompt_ids = [marker, *range(10, 10 + prompt - 1)]
    tokens, masks, logprobs = [], [], []
    for i in range(size):
        done = [100 + marker + i + j for j in range(completion + i)]
        tokens.append(prompt_ids + done)
        masks.append([-100] * prompt + done)
        logprobs.append([1.0] * prompt + [-0.5 - j / 8 for j in range(len(done))])
    group = {"tokens": tokens, "masks": masks, "scores": [float(i % 2) for i in range(size)],
             "inference_logprobs": logprobs, "env_id": env_id}
    group.update(extra)
    return group


@asynccontextmanager
async def api_client(redis: aioredis.Redis, run: str = "atr",
                     **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(AtroposApiSettings(run=run, **settings), redis=redis)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://atropos.test") as client:
        yield client


def marker_of(group: dict[str, Any]) -> int:
    return int(group["tokens"][0][0])


ROOT = Path(__file__).resolve().parents[2]


def until(check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy (HTTP and OS errors count as not
    yet); raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


class Process:
    """A child process in its own session (killed with its children), output to a log."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **(self.env or {})})

    def kill(self) -> None:
        assert self.process is not None
        kill_group(self.process, wait_s=10)

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process, grace_s=10)


class ApiProcess(Process):
    """``rollq atropos-api`` on a free loopback port (uvicorn, as in production)."""

    def __init__(self, redis_url: str, run: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "rollq", "atropos-api", "--redis-url",
                          redis_url, "--run", run, "--port", str(self.port),
                          "--log-format", "json", *extra], log)

    def start(self) -> None:
        super().start()
        until(lambda: httpx.get(f"{self.url}/info", timeout=1).status_code == 200, 120)
