"""TRL's AsyncGRPOTrainer learns through rollq, in CI: ``examples/trl_async_grpo.py`` (the
script a TRL user writes) trains the tiny model on the demo task (digits: the fraction of
digits in 24 sampled tokens) with rollq's feeder, workers and scorer on the session's CPU
vLLM server, TRL's own loss and optimizer, and rollq's ``rollq_tcp`` weight transfer after
every step. The bar is the example trainer's (tests/integration/test_learning.py): the mean
reward of the last 5 steps beats the first 5 by ``MARGIN``. Measured (2 CPU cores, shared
with other jobs): 0.233 -> 0.599 (272 s with the session server's start); the bench's
runs of the same example and settings (``python -m bench.trl --steps 30``) are in
docs/benchmarks.md.

The flipped-advantage control runs in ``python -m bench.trl --control`` rather than here
(one more run would double this test's time); see docs/benchmarks.md for its figures.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollq.ops.local.demo import DemoOptions, read_metrics, start_roles
from rollq.ops.local.process_groups import Processes
from rollq.ops.local.stack import VllmProcess
from tests.budget import record_figures
from tests.redis_server import RedisServer

pytest.importorskip("trl", reason="needs the trl extra")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trl_async_grpo.py"
STEPS = 30
MARGIN = 0.15
"""Reward points the last 5 of ``STEPS`` steps must gain over the first 5 (measured: see
the test's docstring)."""


def run_example(tmp: Path, run: str, redis_url: str, vllm: VllmProcess, model: Path,
                steps: int, *extra: str) -> list[dict[str, Any]]:
    """The bus's roles and the example under TRL, until the example's last step."""
    options = DemoOptions(out=tmp / run, run=run, redis_url=redis_url, inference=vllm.url,
                          model=model, steps=steps)
    logs = tmp / run / "logs"
    logs.mkdir(parents=True)
    metrics = tmp / run / "metrics.jsonl"
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_url, "ROLLQ_RUN": run,
           "ROLLQ_LOG_FORMAT": "json", "PYTHONPATH": f"{ROOT}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}", "TRL_EXPERIMENTAL_SILENCE": "1"}
    processes = Processes(logs)
    try:
        start_roles(processes, options, vllm.url, env)
        trainer = processes.start("trainer", [
            sys.executable, str(EXAMPLE), "--redis", redis_url, "--run", run,
            "--model", str(model), "--inference", vllm.url, "--out", str(tmp / run / "trl"),
            "--steps", str(steps), "--metrics", str(metrics), *extra], env)
        deadline = time.monotonic() + 540
        while trainer.poll() is None:
            processes.check()
            assert time.monotonic() < deadline, "the TRL trainer did not finish"
            time.sleep(0.5)
        assert trainer.returncode == 0, (logs / "trainer.log").read_text()[-3000:]
    finally:
        processes.stop()
    return read_metrics(metrics)


def mean_reward(rows: list[dict[str, Any]]) -> float:
    return sum(float(r["reward_mean"]) for r in rows) / len(rows)


def test_trl_learns_through_rollq(vllm_server: VllmProcess, redis_server: RedisServer,
                                  tiny_model: Path, tmp_path: Path,
                                  request: pytest.FixtureRequest) -> None:
    rows = run_example(tmp_path, "trl", redis_server.url, vllm_server, tiny_model, STEPS)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = mean_reward(rows[:5]), mean_reward(rows[-5:])
    record_figures(request, f"reward first 5 {first:.3f} -> last 5 {last:.3f} (bar +{MARGIN})")
    assert last > first + MARGIN, f"reward {first:.3f} -> {last:.3f}: TRL did not learn"
