"""A tool-use task learned through ``rollq gateway``: the short CI version of
``rollq demo --task tools`` (docs/guides/demo-tools.md).

The tiny model (its tokenizer knowing tool calls) is warm-started on the call format with
random answers (its answers must sit at chance, 1/10), then the whole loop trains ``STEPS``
steps: vLLM with the hermes tool parser, ``rollq gateway``, the unmodified ``openai``-package
calculator agent in ``rollq workers``, ``rollq score``, the example trainer. The greedy
accuracy on the 122 training questions must end at least ``MARGIN`` above chance, with the
call format kept (``FORMAT_FLOOR``). The demo starts its own vLLM: the tools model has its
own tokenizer (and vocabulary), so the session's servers cannot load it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.demo_sums import learning_curves
from rollq.producers.envs.tools import CHANCE
from tests.integration.interpreters import vllm_python
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 240
MARGIN = 0.2
"""Greedy training-question accuracy after STEPS must reach CHANCE + MARGIN (0.30), above
the 0.19 of the policy answering 0 to everything, where every run sits before the copy of
the tool's result takes off. The takeoff comes between steps 75 and 175: measured (2 CPU
cores, the demo's recipe) 0.96 and 0.74 at step 150, 1.0 and 0.99 at step 180 in four quiet
demo runs (docs/guides/demo-tools.md); in CI runs of this test, beside other jobs, 0.57 at
step 150, 0.81 and 0.295 at step 180 (that one 0.19 at step 120: it took off at ~170). So
the test runs 60 steps past the demo's default 180. About 18 minutes here."""

FORMAT_FLOOR = 0.7
"""The greedy format (a ``calc`` call, then a number) at every evaluation. It dips while the
copy takes off (some first replies answer without calling) and recovers within ~40 steps:
measured 0.820 at step 100 of a quiet seed-0 run (1.0 again at 140), and 0.836 at step
180 of a CI run whose takeoff came late (accuracy 0.81). A policy abandoning the tool falls
towards 0 (the flipped control: 0.0 by step 125)."""


def test_tool_use_rises_from_chance_through_the_gateway(
        redis_server: RedisServer, tmp_path: Path) -> None:
    options = DemoOptions.for_task("tools", out=tmp_path / "tools", run="tools",
                                   redis_url=redis_server.url, vllm_python=vllm_python(),
                                   steps=STEPS, eval_every=60)
    result = run_demo(options, say=lambda _: None)
    warm = result.warm_start
    assert warm is not None  # what the warm start must not teach: the answer
    assert warm["train_answer_probability"] == pytest.approx(CHANCE, abs=0.02)
    assert warm["heldout_answer_probability"] == pytest.approx(CHANCE, abs=0.02)
    curves = learning_curves(result.steps, result.evals)
    assert len(result.steps) == STEPS
    assert curves["train_accuracy_first"] < CHANCE + 0.1, curves["evals"]
    assert curves["train_accuracy_final"] >= CHANCE + MARGIN, curves["evals"]
    assert min(curves["evals"]["train_format"]) >= FORMAT_FLOOR, result.evals
    assert result.plot is not None and result.plot.stat().st_size > 0
