"""The agents' real CPU vLLM: one server per test session with tool calling.

Tool calling needs ``--enable-auto-tool-choice --tool-call-parser hermes`` and a chat
template that renders tools; the tiny model's own template does not, so this server runs
with ``tool_template.jinja``. It is its own server (the integration tier's session server
keeps its flags and template: its tests' prompts are rendered by that template), started
once and shared by every module of ``tests/agents``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollq.ops.local.stack import VllmProcess
from tests.integration.interpreters import vllm_python

TEMPLATE = Path(__file__).with_name("tool_template.jinja")


@pytest.fixture(scope="session")
def tool_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    python = vllm_python()
    from rollq.ops.local.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tool-vllm")
    model = write_tiny_model(directory / "rollq-tiny", seed=0)
    cache = Path(python).absolute().parent.parent / "inductor-cache"
    server = VllmProcess(python, model, directory / "server.log", max_model_len=1024,
                         compile_cache=cache, extra_args=[
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                             "--chat-template", str(TEMPLATE)]).start()
    yield server
    server.stop()
