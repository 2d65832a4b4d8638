"""A template that renders an assistant turn by its place (Qwen3 keeps the ``<think>`` block
of the last turn only) and token-in replies with reasoning, on the fake vLLM: the capture
splices every turn onto what was sampled and hands the agent vLLM's reasoning split.
The same traps on the real Qwen3 template and CPU vLLM: ``test_qwen3_templates.py``."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from rollq.producers.inference.capture import (
    CapturedSequence,
    EpisodeCapture,
    EpisodeClient,
    Upstream,
)
from rollq.producers.inference.capture.reasoning import split_reasoning, thinking_on
from rollq.schemas import Completion
from tests.agents import fake_agent_vllm
from tests.agents.fake_agent_vllm import AgentFakeVLLM, decode, message_text
from tests.agents.helpers import assert_exactly_served, pool_of
from tests.producers.fake_vllm import IM_END, IM_START, encode_text


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>\nhmm\n</think>\n\nok 42", ("\nhmm\n", "\n\nok 42")),
    ("hmm</think>ok", ("hmm", "ok")),  # the prompt opened the block
    ("<think>still thinking", ("still thinking", None)),  # cut short: all reasoning
    ("<think>x<tool_call>{}</tool_call>", ("x", "<tool_call>{}</tool_call>")),
    ("<think></think>ok</think>", (None, "ok")),  # a second </think> dropped
])
def test_reasoning_is_split_as_vllms_qwen3_parser_splits_it(
        text: str, expected: tuple[str | None, str | None]) -> None:
    assert split_reasoning(text) == expected


def test_thinking_is_on_unless_the_request_turns_it_off() -> None:
    assert thinking_on({}) and thinking_on({"chat_template_kwargs": {"enable_thinking": True}})
    assert not thinking_on({"chat_template_kwargs": {"enable_thinking": False}})


def by_place(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[int]:
    """The fake's template, Qwen3's rule: an assistant turn's reasoning is rendered
    (``<think>…</think>``) only when it is the last message after the last user turn."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    ids: list[int] = []
    for position, message in enumerate(messages):
        text = message_text(message)
        last = position == len(messages) - 1
        if message.get("reasoning") and position > last_user and last:
            text = f"<think>{message['reasoning']}</think>{text}"
        ids += [IM_START, *encode_text(f"{message['role']}\n{text}")]
        if continue_final_message and last:
            return ids
        ids += [IM_END, *encode_text("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode_text("assistant\n")]
    return ids


class ReasoningFakeVLLM(AgentFakeVLLM):
    """Chat replies split ``<think>…</think>`` into ``reasoning``, as ``--reasoning-parser``."""

    async def _generate(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = await super()._generate(path, body)
        if not path.endswith("chat/completions") or response.status_code != 200:
            return response
        reply = orjson.loads(response.content)
        message = reply["choices"][0]["message"]
        head, _, content = str(message["content"]).partition("</think>")
        message.update(reasoning=head.removeprefix("<think>"), content=content)
        self.replies[-1] = reply
        return httpx.Response(200, content=orjson.dumps(reply),
                              headers={"content-type": "application/json"})


async def test_thinking_turns_dropped_by_the_template_are_spliced_as_sampled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_agent_vllm, "render", by_place)
    fake = ReasoningFakeVLLM()
    fake.script = lambda prompt, number: f"<think>r{number}</think>ok {number}"
    seen = []
    async with pool_of(fake) as pool:
        capture = EpisodeCapture(Upstream(pool))
        client = EpisodeClient(capture)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="m", messages=messages)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            seen.append((message.get("reasoning"), message["content"]))
            messages += [message, {"role": "user", "content": f"more {turn}"}]
        captured = capture.close()
    assert seen == [(f"r{n}", f"ok {n}") for n in range(3)]  # token-in replies too
    assert captured.stats.token_in == 2 and fake.counts["/v1/completions"] == 2
    [sequence] = captured.sequences  # every turn spliced onto the sampled tokens
    trained = decode([t for t, m in zip(sequence.completion_ids, sequence.loss_mask,
                                        strict=True) if m])
    assert all(f"<think>r{n}</think>ok {n}" in trained for n in range(3))
    assert_exactly_served([as_completion(sequence)], [], fake.replies)


def as_completion(sequence: CapturedSequence) -> Completion:
    return Completion(completion_ids=[*sequence.prompt_ids, *sequence.completion_ids],
                      logprobs=[0.0] * len(sequence.prompt_ids) + sequence.logprobs,
                      loss_mask=[0] * len(sequence.prompt_ids) + sequence.loss_mask,
                      policy_version=0, finish_reason=sequence.finish_reason)


async def test_without_a_reasoning_parser_token_in_replies_keep_the_think_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that never split reasoning: a token-in reply leaves it in ``content``, as
    that server's chat route would."""
    monkeypatch.setattr(fake_agent_vllm, "render", by_place)
    fake = AgentFakeVLLM()
    fake.script = lambda prompt, number: f"<think>r{number}</think>ok"
    async with pool_of(fake) as pool:
        client = EpisodeClient(EpisodeCapture(Upstream(pool)))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        contents = []
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages)
            contents.append(reply.choices[0].message.content)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "more"}]
    assert contents == ["<think>r0</think>ok", "<think>r1</think>ok"]
