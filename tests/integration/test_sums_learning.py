"""A reasoning-shaped task learned through rollq: ``sums`` on a real CPU vLLM server.

The short CI version of ``rollq demo --task sums`` / ``bench/learning.py``: the tiny model is
warm-started on the answer format with random answers (its accuracy must sit at chance),
then the whole loop (real Redis, ``rollq feed/workers/score`` processes scoring with
format + math-verify accuracy, the example trainer with a KL term) trains ``STEPS`` steps.
The greedy accuracy on the 80 training problems must end at least ``MARGIN`` above chance
(1/19), with the format kept.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollq.consumers.trainer.weights import PolicyPublisher
from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.demo_sums import learning_curves
from rollq.ops.local.stack import VllmProcess
from rollq.ops.local.warm_start import WarmStartOptions, warm_start
from rollq.producers.envs.sums import CHANCE
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 250
MARGIN = 0.15
"""Greedy training-problem accuracy after STEPS must reach CHANCE + MARGIN (0.203).
Measured at step 250 (2 CPU cores): 0.375, 0.512 and 0.525 in the three seeds of
``bench/learning.py`` (README), 0.40 in a run of this test, 0.475 and 0.56 in earlier runs;
0.338 in the bare loop. At step 200 the lowest was 0.225, too close to the bar: RL takes
off after 100-200 steps."""


@pytest.fixture(scope="module")
def warm_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sums") / "sums-model"
    report = warm_start(tiny_model, out, WarmStartOptions())
    # What the warm start must not teach: P(correct sum | format prefix) stays at chance.
    assert report.train_answer_probability == pytest.approx(CHANCE, abs=0.02)
    assert report.heldout_answer_probability == pytest.approx(CHANCE, abs=0.02)
    assert report.format_loss < 0.05
    return out


def test_sums_accuracy_rises_from_chance_through_rollq(
    vllm_server: VllmProcess, redis_server: RedisServer, warm_model: Path, tiny_model: Path,
    tmp_path: Path
) -> None:
    options = DemoOptions.for_task("sums", out=tmp_path / "sums", run="sums",
                                   redis_url=redis_server.url, inference=vllm_server.url,
                                   model=warm_model, steps=STEPS, eval_every=50)
    # The server must serve the warm start before the workers' first rollouts (they may
    # start before the trainer's first publish), not the tiny model other tests left there.
    try:
        asyncio.run(_publish(vllm_server.url, warm_model))
        result = run_demo(options, say=lambda _: None)
    finally:
        asyncio.run(_publish(vllm_server.url, tiny_model))  # leave the server as it was
    curves = learning_curves(result.steps, result.evals)
    assert len(result.steps) == STEPS
    assert curves["train_accuracy_first"] < CHANCE + 0.1, curves["evals"]
    assert curves["train_accuracy_final"] >= CHANCE + MARGIN, curves["evals"]
    assert min(curves["evals"]["train_format"]) >= 0.95
    # The sampled batch (temperature 1) keeps the format: judged over windows of 10 steps
    # (1,280 completions), not per step. Single steps dip by chance: the README's learning
    # runs have steps at 0.73 and 0.84, and a CI run of this test had one at 0.77 while
    # every evaluation was in format. A format collapse drags a whole window down.
    assert curves["format_min_10"] >= 0.9, curves["steps"]["format"]
    assert result.plot is not None and result.plot.stat().st_size > 0
    assert max(step["staleness"] for step in result.steps) <= 1


async def _publish(url: str, model: Path) -> None:
    async with PolicyPublisher([url]) as publisher:
        await publisher.publish(0, str(model))
