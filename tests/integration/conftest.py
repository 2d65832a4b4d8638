"""The integration tier: real CPU vLLM servers.

The session's server with the tiny model (``vllm_server``, ``tiny_model``) is defined in
``tests/conftest.py``, shared with ``tests/agents``. It starts once per test session when
``ROLLQ_TEST_VLLM_PYTHON`` names the interpreter of a virtual environment with vLLM
(``.ci/test`` sets it up). Without it the tier is skipped, unless ``ROLLQ_REQUIRE_VLLM=1``
(CI), where a missing vLLM fails the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollq.ops.local.stack import VllmProcess
from tests.integration.interpreters import vllm_python


@pytest.fixture(scope="session")
def lora_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """A second server of the tiny model that serves LoRA adapters loaded at run time
    (``weight_sync='lora'``); started once, for the tests that need it."""
    python = vllm_python()
    cache = Path(python).resolve().parent.parent / "inductor-cache"
    server = VllmProcess(python, tiny_model, tmp_path_factory.mktemp("vllm-lora") / "server.log",
                         compile_cache=cache, served_name="rollq-tiny",
                         extra_args=["--enable-lora", "--max-lora-rank", "8",
                                     "--max-loras", "2"],
                         environment={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}).start()
    yield server
    server.stop()
