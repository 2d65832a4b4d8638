"""SmolLM2-135M-Instruct on a real CPU vLLM server: the conversion proven, and a few GRPO
steps through the whole loop.

- vLLM's logprobs for fixed prompts equal a torch forward of the same folder
  (transformers' ``LlamaForCausalLM``), float32 on both sides; and the greedy reply to a
  fixed question is a fixed, sensible string. A wrong permutation, shape or tokenizer
  would fail both.
- The smoke: ``rollq demo --task smollm2`` for a few steps against the session's server
  (``rollq feed``, ``workers``, ``score``, the example trainer with weight transfer): the
  trainer's token ids are the server's (the prompt is the server's own rendering of the
  chat, the completion decodes to the text it came with), the sync makes the served
  logprobs the trainer's, the versions are the steps. It trains the embeddings and the
  output layer too, which a tied folder would serve stale (``ops.local.smollm2``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from rollq.ops.local.demo import DemoOptions, run_demo
from rollq.ops.local.smollm2 import MODEL_NAME
from rollq.ops.local.stack import VllmProcess
from rollq.schemas import decode_trajectory
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key, stream_key
from tests.integration.conftest import restore_weights
from tests.redis_server import RedisServer

torch = pytest.importorskip("torch", reason="needs the train extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is Paris, and the capital of Italy is",
           "def fibonacci(n):\n    return",
           "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n"]
TOLERANCE = 2e-3
"""Largest logprob difference, float32 server and trainer (measured: see the test)."""
QUESTION = "What is the capital of France?"
REPLY = "The capital of France is Paris."


def largest_gap(url: str, model: Any) -> float:
    from bench.weight_sync import largest_gap as gap  # imports torch: after the skip

    return gap(url, model, PROMPTS, name=MODEL_NAME)


def test_vllm_serves_what_a_torch_forward_of_the_folder_computes(
        smollm2_server: VllmProcess, smollm2_model: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_model, dtype=torch.float32).eval()
    assert largest_gap(smollm2_server.url, model) < TOLERANCE
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 30, "temperature": 0})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == REPLY and choice["finish_reason"] == "stop"


def test_a_few_grpo_steps_through_rollq(
        smollm2_server: VllmProcess, smollm2_model: Path, redis_server: RedisServer,
        tmp_path: Path) -> None:
    steps, groups = 3, 4
    try:
        result = run_demo(DemoOptions.for_task(
            "smollm2", out=tmp_path / "demo", run="smollm2-smoke", redis_url=redis_server.url,
            inference=smollm2_server.url, model=smollm2_model, steps=steps,
            batch_groups=groups, group_size=4, eval_every=0, lr=1e-4,
            checkpoint_every=steps, freeze_embeddings=False), say=lambda _: None)
        assert [row["step"] for row in result.steps] == list(range(1, steps + 1))
        trained = _trained_weights(tmp_path / "demo" / "trainer" / "checkpoint.pt",
                                   smollm2_model)
        original = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_model, dtype=torch.float32).eval()
        # the output layer trained (a tied folder's would stay stale in vLLM) ...
        assert not torch.equal(trained.lm_head.weight, original.lm_head.weight)
        # ... and vLLM serves the trained weights, not the ones it started with
        assert largest_gap(smollm2_server.url, trained) < TOLERANCE
        assert largest_gap(smollm2_server.url, original) > 5 * TOLERANCE
        info = httpx.get(f"{smollm2_server.url}/weight_info", timeout=30).json()
        assert info["weight_version"] == str(steps)
        asyncio.run(_check_groups(redis_server.url, smollm2_server.url, smollm2_model, steps))
    finally:
        restore_weights(smollm2_server)


def _trained_weights(checkpoint: Path, folder: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(torch.load(checkpoint, weights_only=False)["model"])
    return model.eval()


async def _check_groups(redis_url: str, url: str, folder: Path, steps: int) -> None:
    """Token ids are the server's, versions stay within the run's staleness bound."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert int(await client.hget(state_key("smollm2-smoke"), POLICY_VERSION_FIELD)) == steps
        entries = await client.xrange(stream_key("smollm2-smoke", 0, "traj"))
    finally:
        await client.aclose()
    assert entries
    async with httpx.AsyncClient(timeout=60) as http:
        for _, fields in entries:
            group = decode_trajectory(fields)
            assert 0 <= group.policy_version <= steps  # the last ones: after the last step
            messages = group.prompt_messages
            assert messages is not None and messages[-1]["content"].startswith("What is ")
            rendered = (await http.post(f"{url}/tokenize", json={
                "model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
            )).json()["tokens"]
            assert list(group.prompt_ids) == rendered == tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for completion in group.completions:
                ids = list(completion.completion_ids)
                assert tokenizer.decode(ids, skip_special_tokens=True) == completion.text
                assert len(completion.logprobs) == len(ids)
