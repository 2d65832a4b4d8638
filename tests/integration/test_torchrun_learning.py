"""The torchrun trainer learns through rollq: ``examples/torchrun_trainer.py`` as 2 CPU
ranks (DDP over gloo, one torch thread each) beside the real CPU vLLM server, with the
same roles, task and bar as ``test_learning``'s single-process run, its weights moved by
``transfer`` (vLLM's weight-transfer API, rollq_tcp) where that run reloads from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollq.ops.local.demo import run_demo
from rollq.ops.local.stack import VllmProcess
from tests.integration.test_learning import MARGIN, options
from tests.redis_server import RedisServer

pytest.importorskip("torch", reason="needs the train extra")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_two_torchrun_ranks_learn(
    vllm_server: VllmProcess, redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    learned = run_demo(options(tmp_path, "ranks", redis_server.url, vllm_server, tiny_model,
                               steps=30, trainer_ranks=2, torch_threads=1,
                               weight_sync="transfer"),
                       say=lambda _: None)
    assert len(learned.steps) == 30
    assert {step["ranks"] for step in learned.steps} == {2}
    assert {step["weight_sync"] for step in learned.steps} == {"transfer"}
    first, last = learned.reward_at(first=True), learned.reward_at(first=False)
    assert last > first + MARGIN, f"reward {first:.3f} -> {last:.3f}: did not learn"
