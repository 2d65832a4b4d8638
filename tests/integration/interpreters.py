"""Where the integration tier finds the vLLM interpreter."""

from __future__ import annotations

import os

import pytest


def vllm_python() -> str:
    """The vLLM interpreter (``ROLLQ_TEST_VLLM_PYTHON``); skips the test without one, or
    fails it where CI requires vLLM."""
    python = os.environ.get("ROLLQ_TEST_VLLM_PYTHON", "")
    if not python:
        if os.environ.get("ROLLQ_REQUIRE_VLLM") == "1":
            pytest.fail("ROLLQ_REQUIRE_VLLM=1 but ROLLQ_TEST_VLLM_PYTHON is not set")
        pytest.skip("no vLLM: set ROLLQ_TEST_VLLM_PYTHON (bash .ci/test does)")
    return python
