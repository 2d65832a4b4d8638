"""The integration tier: real CPU vLLM servers.

The session's server with the tiny model (``vllm_server``, ``tiny_model``) is defined in
``tests/conftest.py``, shared with ``tests/agents``. It starts once per test session when
``ROLLQ_TEST_VLLM_PYTHON`` names the interpreter of a virtual environment with vLLM
(``.ci/test`` sets it up). Without it the tier is skipped, unless ``ROLLQ_REQUIRE_VLLM=1``
(CI), where a missing vLLM fails the run.
"""
