"""Data-parallel ranks as real torchrun processes (gloo, CPU) over a real redis-server:
every published group is trained exactly once, with 2 and 4 ranks, and when a non-zero
rank is SIGKILLed mid-step and torchrun restarts every rank from the last checkpoint.

The trainer is ``bench.pipeline``'s toy (``trainer --data-parallel``): its "model" counts
how often each group was trained, and a group counts only when every one of its
sequences was trained exactly once in its step (across the ranks)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, publish_many

pytest.importorskip("torch", reason="needs the train extra")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parent.parent.parent


def torchrun(ranks: int, url: str, directory: Path, *extra: str,
             step_s: float = 0.0) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "--max-restarts", "1", "--monitor-interval", "0.2",
            "-m", "bench.pipeline", "trainer", "--data-parallel", "--run-name", RUN,
            "--redis-url", url, "--checkpoint", str(directory / "trainer.json"),
            "--batch-groups", "3", "--micro-batch-tokens", "40", "--step-s", str(step_s),
            "--exit-when-idle", "2", *extra]
    # the ranks import this checkout's packages (cwd is on the path of `-m`, PYTHONPATH
    # keeps it first for the launcher too)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "ROLLQ_LOG_FORMAT": "json"}
    with (directory / "torchrun.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def trained(directory: Path) -> dict[int, int]:
    saved = json.loads((directory / "trainer.json").read_text())
    return {p: n for p, n in enumerate(bytes.fromhex(saved["counts"])) if n}


def finish(process: subprocess.Popen[bytes], directory: Path, timeout_s: float = 60) -> None:
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = -1
    assert code == 0, (directory / "torchrun.log").read_text(errors="replace")[-4000:]


@pytest.mark.parametrize("ranks", [2, 4])
async def test_every_group_is_trained_once_over_torchrun_ranks(
    redis_server: RedisServer, real_redis: aioredis.Redis, tmp_path: Path, ranks: int
) -> None:
    await publish_many(real_redis, 15)
    process = torchrun(ranks, redis_server.url, tmp_path)
    finish(process, tmp_path)
    assert trained(tmp_path) == dict.fromkeys(range(15), 1)
    pending = await real_redis.xpending(f"rollq:{{{RUN}:0}}:scored", "trainer")
    assert pending["pending"] == 0


def rank_pid(directory: Path, rank: int) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((directory / f"rank-{rank}.pid").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return found


async def test_a_killed_rank_restarts_the_job_and_no_group_is_lost_or_repeated(
    redis_server: RedisServer, real_redis: aioredis.Redis, tmp_path: Path
) -> None:
    await publish_many(real_redis, 30)
    process = torchrun(2, redis_server.url, tmp_path, step_s=0.3)
    try:
        deadline = time.monotonic() + 45
        while not (tmp_path / "trainer.json").exists() or \
                json.loads((tmp_path / "trainer.json").read_text())["step"] < 3:
            assert process.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "torchrun.log").read_text(errors="replace")[-3000:]
            await asyncio.sleep(0.05)
        victim = rank_pid(tmp_path, 1)
        assert victim is not None and victim["restart"] == "0"
        os.kill(victim["pid"], signal.SIGKILL)  # mid-step: the ranks sleep in "training"
    finally:
        finish(process, tmp_path, timeout_s=80)
    restarted = rank_pid(tmp_path, 1)
    assert restarted is not None and restarted["restart"] == "1", "torchrun did not restart"
    counts = trained(tmp_path)
    lost = [p for p in range(30) if p not in counts]
    duplicated = [p for p, n in counts.items() if n > 1]
    assert (lost, duplicated) == ([], []), f"lost {lost}, duplicated {duplicated}"
