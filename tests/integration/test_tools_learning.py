"""A tool-use task learned through ``rollq gateway``: ``tools`` on a real CPU vLLM server.

The short CI version of ``rollq demo --task tools``: the tiny model is warm-started on the
``calc`` call format with random final answers (its answer probability must sit at chance,
1/19), then served by a vLLM with tool calling (``--enable-auto-tool-choice
--tool-call-parser hermes``; the warm start's tokenizer carries the tools template). The
whole loop runs as processes: ``rollq gateway``, ``rollq feed/workers/score`` (the
unmodified ``openai`` calculator agent per episode, on the gateway's captured base URLs),
the example trainer with a KL term. The greedy accuracy of the same agent on the 80
training problems must rise clearly above the warm start's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.demo import DemoOptions, run_demo
from ops.demo_sums import learning_curves
from ops.stack import VllmProcess
from ops.warm_start_tools import warm_start_tools
from producers.envs.sums import CHANCE
from producers.envs.tools import VLLM_TOOL_FLAGS
from tests.integration.interpreters import vllm_python
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 250
MARGIN = 0.15
"""Greedy training-problem accuracy after STEPS must be at least MARGIN above the first
evaluation's (which sits near chance, 1/19): the sums test's bar and length. Not yet
measured to pass: in the one run of this recipe so far (docs/demo-tools.md, a machine at
load 17-33 on 2 cores) the greedy accuracy went 0.025 -> 0.100 by step 20 and stayed there
to step 60+, the batch accuracy flat at ~0.04."""


@pytest.fixture(scope="module")
def warm_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tools") / "tools-model"
    report = warm_start_tools(tiny_model, out)
    # What the warm start must not teach: P(correct answer | the tool's result) at chance.
    assert report.train_answer_probability == pytest.approx(CHANCE, abs=0.02)
    assert report.heldout_answer_probability == pytest.approx(CHANCE, abs=0.02)
    # What it must teach: the whole call, on problems it never saw.
    assert report.call_probability > 0.6
    return out


@pytest.fixture(scope="module")
def tool_server(warm_model: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[VllmProcess]:
    python = vllm_python()
    cache = Path(python).resolve().parent.parent / "inductor-cache"
    server = VllmProcess(python, warm_model, tmp_path_factory.mktemp("vllm") / "server.log",
                         compile_cache=cache, extra_args=VLLM_TOOL_FLAGS).start()
    yield server
    server.stop()


def test_tool_use_accuracy_rises_through_the_gateway(
    tool_server: VllmProcess, redis_server: RedisServer, warm_model: Path, tmp_path: Path
) -> None:
    options = DemoOptions.for_task("tools", out=tmp_path / "tools", run="tools",
                                   redis_url=redis_server.url, inference=tool_server.url,
                                   model=warm_model, steps=STEPS, eval_every=50)
    result = run_demo(options, say=lambda _: None)
    curves = learning_curves(result.steps, result.evals)
    assert len(result.steps) == STEPS
    first, final = curves["train_accuracy_first"], curves["train_accuracy_final"]
    assert first < CHANCE + 0.1, curves["evals"]
    assert final >= first + MARGIN, curves["evals"]
    # the agent still calls the tool and answers with a number, greedily, at every evaluation
    assert min(curves["evals"]["train_format"]) >= 0.9, curves["evals"]
    assert result.plot is not None and result.plot.stat().st_size > 0
    assert max(step["staleness"] for step in result.steps) <= 1
    # every episode went through the gateway: none was lost on the way
    assert not {k: v for k, v in result.drops.items() if k != "stale"}, result.drops
