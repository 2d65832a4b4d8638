"""An Atropos env started exactly as docs/guides/atropos.md shows (``rollq atropos-env FILE serve
--openai.* …``: its inference at ``rollq atropos-api --inference``'s ``/inference/v1``)
reaches the trainer, and keeps running through a 5 s Redis restart and a restart of the
API process (issue 32, items 4 and 6): the API holds requests while Redis is away
instead of answering 503, and ``rollq atropos-env`` retries the env's API calls while
the API itself is away, so the env's process does not exit.

The env file returns one server config from ``config_init`` (``lone_server_env``), the
case atroposlib 0.4.0 alone sends to ``localhost:9004..9007``; the vLLM behind the API is
the fake one (``tests.producers.fake_vllm``) on a loopback port, so no model is needed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, ApiProcess, Process
from tests.producers.fake_vllm import FakeVLLM
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")

GROUP_SIZE = 4  # tests.atropos.atropos_envs.GROUP_SIZE (not imported: it imports atroposlib)
BATCH = 2 * GROUP_SIZE


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted(tmp_path.glob("*.log")))


async def _until_groups(client: httpx.AsyncClient, groups: list[dict[str, Any]], count: int,
                        env: Process, timeout_s: float) -> None:
    """Poll ``/batch`` as an Atropos trainer does until ``count`` groups arrived; fails
    at once if the env process exits."""
    async with asyncio.timeout(timeout_s):
        while len(groups) < count:
            assert env.process is not None and env.process.poll() is None, "the env exited"
            batch = (await client.get("/batch")).json()["batch"]
            if batch is None:
                await asyncio.sleep(0.2)
                continue
            assert sum(len(group["tokens"]) for group in batch) == BATCH
            groups.extend(batch)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_env_started_as_documented_reaches_the_trainer_and_rides_out_restarts(
        make_redis_server: type[RedisServer], tmp_path: Path) -> None:
    from rollq.ops.local.tiny_model import (
        _write_tokenizer,  # the tiny model's tokenizer, without torch
    )

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    _write_tokenizer(tokenizer, seed=0)
    redis = make_redis_server(appendonly=True).start()  # type: ignore[call-arg]
    fake = FakeVLLM()
    async with serve_fake(fake) as vllm_url:
        api = ApiProcess(redis.url, "cmdline", tmp_path / "api.log", "--inference", vllm_url)
        await asyncio.to_thread(api.start)
        env = Process([sys.executable, "-m", "rollq", "atropos-env",
                       "tests/atropos/lone_server_env.py", "serve",
                       "--env.rollout_server_url", api.url,
                       "--openai.server_type", "vllm",
                       "--openai.base_url", f"{api.url}/inference/v1",
                       "--openai.model_name", fake.model,
                       "--openai.tokenizer_name", str(tokenizer)],
                      tmp_path / "env.log",
                      {"ROLLQ_TEST_TOKENIZER": str(tokenizer), "WANDB_MODE": "disabled",
                       "ROLLQ_TEST_OPENAI_URL": "http://127.0.0.1:9/v1"})
        groups: list[dict[str, Any]] = []
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=120) as client:
                await client.post("/register", json={**REGISTRATION, "batch_size": BATCH})
                assert (await client.get("/batch")).json() == {"batch": None}
                env.start()
                # env start-up imports torch: minutes on a loaded machine
                await _until_groups(client, groups, BATCH // GROUP_SIZE, env, 480)
                assert "using http://127.0.0.1" in env.log.read_text()
                before = len(groups)
                await asyncio.to_thread(redis.kill)
                await asyncio.sleep(5)  # Redis is away for 5 s; the env keeps polling
                await asyncio.to_thread(redis.start)
                await _until_groups(client, groups, before + 2 * BATCH // GROUP_SIZE, env, 180)
                before = len(groups)
                await asyncio.to_thread(api.kill)  # SIGKILL, started again at once
                await asyncio.to_thread(api.start)
                await _until_groups(client, groups, before + 2 * BATCH // GROUP_SIZE, env, 180)
                assert env.process is not None and env.process.poll() is None
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"{exc!r}\n{_logs(tmp_path)}") from None
        finally:
            await asyncio.to_thread(env.stop)
            await asyncio.to_thread(api.stop)
    assert "redis_outage_held" in api.log.read_text()  # requests were held, not failed
    assert fake.counts  # the model calls went to the server the flags named
    for group in groups:
        assert len(group["tokens"]) == GROUP_SIZE
