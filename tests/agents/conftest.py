"""The agents' real CPU vLLM: the session's server (``tests/conftest.py``), which serves the
tiny model with tool calling (``--enable-auto-tool-choice --tool-call-parser hermes``) and
``tool_template.jinja``, a template that renders tools and tool calls and renders plain
messages exactly as the tiny model's own template does."""

from __future__ import annotations

import pytest

from rollq.ops.local.stack import VllmProcess


@pytest.fixture
def tool_vllm(vllm_server: VllmProcess) -> VllmProcess:
    return vllm_server
