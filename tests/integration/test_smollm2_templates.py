"""SmolLM2-135M-Instruct's ChatML (the single-template case, a real model) through the same
capture paths as Qwen3's traps (``tests/agents/test_qwen3_templates.py``): turns forced by
structured outputs, one cut short by ``max_tokens``, then the history edited (the first
user message rewritten). The same replies as straight to vLLM; trained tokens exactly the
sampled ones; the edit opens a new sequence. It shares the session's ``smollm2_server``."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from rollq.ops.local.stack import VllmProcess
from tests.agents.test_qwen3_templates import run_trap
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


async def test_smollm2_chatml_turns_are_token_exact_on_every_path(
        smollm2_server: VllmProcess, redis_server: RedisServer,
        real_redis: aioredis.Redis) -> None:
    runs = await run_trap(smollm2_server, "chatml-turns", redis_server, real_redis)
    assert runs["direct"].seen[2][3] == "length"
    for path in ("episode", "gateway", "session"):
        group, _, stats, _ = runs[path]
        assert len(group.completions) == 2  # the edited history: a new sequence
        assert stats["calls"] == 4
