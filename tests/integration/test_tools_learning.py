"""A tool-use task learned through ``rollq gateway``: the CI proof. The full curve from
chance is ``rollq demo --task tools`` (docs/guides/demo-tools.md, its rows in
docs/benchmarks.md: 0.09 to 0.96-1.0 in 150-180 steps); it is too long for the suite (the
copy of the tool's result takes off anywhere between steps 75 and 175).

Here the tiny model (its tokenizer knowing tool calls) is warm-started on the call format with
``RIGHT_FRACTION`` of its final answers copying the tool's result and the rest random, so its
teacher-forced probability of the right answer after the tool starts at ~0.35 (measured
exactly by the warm start) and every step has a signal. Then the whole loop trains ``STEPS``
steps: vLLM with the hermes tool parser, ``rollq gateway``, the unmodified ``openai``-package
calculator agent in ``rollq workers``, ``rollq score``, the example trainer. The accuracy of
the sampled episodes (a ``calc`` call, then the tool's result as the answer) over the last 10
steps must exceed that start by ``MARGIN``. What it proves is what the long run proves: the
episode's trained sequence holds the model's call, the tool's result (masked) and the answer
exactly as the model saw them, or the copy's signal is lost. The demo starts its own vLLM: the
tools model has its own tokenizer (and vocabulary), so the session's servers cannot load it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.demo_sums import learning_curves
from tests.budget import record_figures
from tests.integration.interpreters import vllm_python
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 30
RIGHT_FRACTION = 0.3
MARGIN = 0.2
"""The sampled accuracy of the last 10 of ``STEPS`` steps must reach the warm start's
probability of the right answer plus MARGIN (0.345 + 0.2 = 0.545). Measured on 2 CPU cores,
the warm start's probability then the last-10 mean, each run beside other jobs:
0.345 -> 0.742 (three other sessions' jobs, load 7-9; 0.858 had it run to step 40);
0.345 -> 0.805 and 0.345 -> 0.806 (each beside a CI run and two or three other jobs, load
10-23); 0.720 and 0.784 in two CI runs on fresh clones (quiet machine, 232 s); two CI runs
passed without recording their figures. The lowest, 0.720, clears the bar by 0.175.
A sixth run beside a CI run's vLLM tier (load ~13) did not finish its 30 steps in 900 s,
hence the 1,200 s timeout. A broken capture stays at the start (~0.35)."""


def test_tool_use_rises_through_the_gateway(redis_server: RedisServer, tmp_path: Path,
                                            request: pytest.FixtureRequest) -> None:
    options = DemoOptions.for_task("tools", out=tmp_path / "tools", run="tools",
                                   redis_url=redis_server.url, vllm_python=vllm_python(),
                                   steps=STEPS, eval_every=0,
                                   warm_start_right_fraction=RIGHT_FRACTION)
    result = run_demo(options, say=lambda _: None)
    warm = result.warm_start
    assert warm is not None  # what the warm start taught: above chance, far from the answer
    start = warm["train_answer_probability"]
    assert 0.25 < start < 0.45, warm
    assert warm["call_probability"] > 0.8, warm  # the call format, learned
    curves = learning_curves(result.steps, result.evals)
    accuracy = curves["steps"]["batch_accuracy"]
    assert len(result.steps) == STEPS
    last = sum(accuracy[-10:]) / 10
    record_figures(request, f"warm start P {start:.3f} -> sampled accuracy of the last 10 "
                   f"{last:.3f} (bar {start + MARGIN:.3f})")
    assert last >= start + MARGIN, f"{start:.3f} -> {last:.3f}: {accuracy}"
    assert max(step["staleness"] for step in result.steps) <= 1
    assert result.plot is not None and result.plot.stat().st_size > 0
