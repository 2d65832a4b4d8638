"""A reasoning-shaped task learned through rollq: ``sums`` on a real CPU vLLM server, the
CI proof. The full curve from chance is ``rollq demo --task sums`` / ``bench/learning.py``
(docs/benchmarks.md: greedy accuracy from chance, 1/19, to 0.4-0.5 in 250 steps, RL taking
off after 100-200 of them); it is too long for the suite.

Here the tiny model is warm-started on the answer format with ``RIGHT_FRACTION`` of its
boxed answers right and the rest random, so its teacher-forced probability of the right sum
starts above chance (~0.18 on the training problems, measured exactly by the warm start)
and every step has a signal. Then the whole loop (real Redis, ``rollq feed/workers/score``
processes scoring with format + math-verify accuracy, the example trainer with a KL term)
trains ``STEPS`` steps. The accuracy of the sampled batches over the last 10 steps must
exceed that start by ``MARGIN``, with the format kept.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollq.consumers.trainer.weights import PolicyPublisher
from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.demo_sums import learning_curves
from rollq.ops.local.stack import VllmProcess
from rollq.ops.local.warm_start import WarmStartOptions, warm_start
from rollq.producers.envs.sums import CHANCE
from tests.budget import record_figures
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 30
RIGHT_FRACTION = 0.3
MARGIN = 0.15
"""The sampled accuracy of the last 10 of ``STEPS`` steps must reach the warm start's
probability of the right sum plus MARGIN (0.176 + 0.15 = 0.326). Measured on 2 CPU cores,
the warm start's probability then the last-10 mean (format: the lowest 10-step window):
0.176 -> 0.500 (three other sessions' jobs, load 6-8; 0.519 had it run to step 40);
0.176 -> 0.530 (format 0.946), 0.504 (0.942) and 0.527 (0.959), each beside a CI run and two
or three other jobs (load 10-23); 0.504 and 0.505 (0.952) in two CI runs on fresh clones
(quiet machine, 71 s); and two CI runs passed without recording their figures. The lowest,
0.500, clears the bar by 0.17; the format floor 0.9 sits 0.04 under the lowest window."""


@pytest.fixture(scope="module")
def warm_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sums") / "sums-model"
    report = warm_start(tiny_model, out, WarmStartOptions(right_fraction=RIGHT_FRACTION),
                        threads=1)  # beside the session's vLLM server
    # What the warm start taught: the format, and the right sums above chance, far from all
    assert CHANCE + 0.05 < report.train_answer_probability < 0.4, report
    assert report.format_loss < 0.05
    return out


def test_sums_accuracy_rises_through_rollq(
    vllm_server: VllmProcess, redis_server: RedisServer, warm_model: Path, tiny_model: Path,
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options = DemoOptions.for_task("sums", out=tmp_path / "sums", run="sums",
                                   redis_url=redis_server.url, inference=vllm_server.url,
                                   model=warm_model, steps=STEPS, eval_every=0)
    # The server must serve the warm start before the workers' first rollouts (they may
    # start before the trainer's first publish), not the tiny model other tests left there.
    try:
        asyncio.run(_publish(vllm_server.url, warm_model))
        result = run_demo(options, say=lambda _: None)
    finally:
        asyncio.run(_publish(vllm_server.url, tiny_model))  # leave the server as it was
    curves = learning_curves(result.steps, result.evals)
    assert len(result.steps) == STEPS
    start = json.loads((warm_model / "warm_start.json").read_text())["train_answer_probability"]
    accuracy = curves["steps"]["batch_accuracy"]
    last = sum(accuracy[-10:]) / 10
    record_figures(request, f"warm start P {start:.3f} -> sampled accuracy of the last 10 "
                   f"{last:.3f} (bar {start + MARGIN:.3f}); format min over 10 steps "
                   f"{curves['format_min_10']:.3f} (bar 0.9)")
    assert last >= start + MARGIN, f"{start:.3f} -> {last:.3f}: {accuracy}"
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
