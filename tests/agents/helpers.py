"""Shared checks: trainable tokens are exactly what the server returned."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rollq.producers.inference import InferencePool
from rollq.schemas import Completion
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.producers.fake_vllm import fake_transport


def pool_of(fake: AgentFakeVLLM) -> InferencePool:
    return InferencePool([fake.base_url], model="rollq-tiny", transport=fake_transport(fake),
                         health_interval_s=None)


def tool_script(*, compact: bool) -> Any:
    """Scripted model: a calculator call on each of the first two turns, then an answer.
    ``compact`` JSON is re-rendered differently by the template (drift)."""

    def script(prompt: str, number: int) -> str:
        seen = prompt.count("<|im_start|>tool")
        if seen >= 2:
            return "The answer is 20"
        call = {"name": "calculator", "arguments": {"expression": ["6*7", "5*4"][seen]}}
        if compact:
            return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"
        return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"

    return script


def trainable_runs(completion: Completion) -> list[tuple[list[int], list[float]]]:
    """The maximal runs of trainable tokens, with their logprobs."""
    runs: list[tuple[list[int], list[float]]] = []
    previous = 0
    for token, logprob, mask in zip(completion.completion_ids.tolist(),
                                     completion.logprobs.tolist(),
                                     completion.loss_mask.tolist(), strict=True):
        if mask:
            if not previous:
                runs.append(([], []))
            runs[-1][0].append(token)
            runs[-1][1].append(logprob)
        else:
            assert logprob == 0.0  # env tokens carry logprob 0
        previous = mask
    return runs


def served(reply: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Completion ids and logprobs of a server reply (float32, as stored)."""
    choice = reply["choices"][0]
    block = choice["logprobs"]
    logprobs = (block["token_logprobs"] if "token_logprobs" in block
                else [entry["logprob"] for entry in block["content"]])
    return choice["token_ids"], np.asarray(logprobs, dtype=np.float32).tolist()


def served_prompt(reply: dict[str, Any]) -> list[int]:
    return list(reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"])


def kept_replies(completions: list[Completion], prompt_ids: list[int],
                 replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The replies some sequence holds (prompt and completion); the others were discarded
    (a gateway checking continuations ``after`` resends a drifted call token-in)."""
    sequences = [[*prompt_ids, *c.completion_ids.tolist()] for c in completions]
    return [reply for reply in replies
            if any(seq[:len(served_prompt(reply)) + len(served(reply)[0])]
                   == served_prompt(reply) + served(reply)[0] for seq in sequences)]


def assert_exactly_served(completions: list[Completion], prompt_ids: list[int],
                          replies: list[dict[str, Any]]) -> None:
    """Every trainable run is one server reply, id for id and logprob for logprob; every
    reply is used once; each call's prompt is a prefix of its sequence."""
    runs = [run for completion in completions for run in trainable_runs(completion)]
    expected = [served(reply) for reply in replies]
    assert sorted(runs) == sorted(expected)
    sequences = [[*prompt_ids, *c.completion_ids.tolist()] for c in completions]
    for reply in replies:
        ids, _ = served(reply)
        prompt = served_prompt(reply)
        assert any(seq[:len(prompt) + len(ids)] == prompt + ids for seq in sequences)
