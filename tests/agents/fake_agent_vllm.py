"""The fake vLLM of ``tests.producers.fake_vllm`` with what agents need: tools and drift.

- The chat template renders ``tools`` (a system block), assistant ``tool_calls`` as Hermes
  blocks with ``json.dumps``'s spacing (``<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>``), and ``tool`` messages as their own turn. A model that writes compact
  JSON is therefore re-rendered differently: the text path drifts, as with real templates.
- Chat replies with ``tools`` (and ``tool_choice`` not ``none``) parse Hermes tool calls
  from the generated text (``finish_reason: tool_calls``), like ``--tool-call-parser
  hermes``.
- ``merge_ok``: the model emits one token, ``PAIR`` (id 70), for the text ``ok``, which the
  tokenizer (one token per character) never produces: re-tokenising drifts.
- ``script(prompt_text, call_number) -> reply text``: the reply of each generation call in
  order (call numbers count every generation request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from rollq.producers.inference.capture.toolcalls import parse_hermes
from tests.producers.fake_vllm import (
    EOS,
    IM_END,
    IM_START,
    TEXT_OFFSET,
    FakeVLLM,
    encode_text,
    logprob_of,
)

PAIR = 70


def decode(ids: list[int]) -> str:
    names = {IM_START: "<|im_start|>", IM_END: "<|im_end|>", PAIR: "ok"}
    return "".join(names.get(i, chr(i - TEXT_OFFSET) if i >= TEXT_OFFSET else "?") for i in ids)


def message_text(message: dict[str, Any]) -> str:
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        function = call["function"]
        text += "<tool_call>\n" + json.dumps({"name": function["name"], "arguments": json.loads(
            function["arguments"])}) + "\n</tool_call>"
    return text


def render(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    ids: list[int] = []
    if tools:
        names = ", ".join(tool["function"]["name"] for tool in tools)
        ids += [IM_START, *encode_text(f"system\ntools: {names}"), IM_END, *encode_text("\n")]
    for position, message in enumerate(messages):
        ids += [IM_START, *encode_text(f"{message['role']}\n{message_text(message)}")]
        if continue_final_message and position == len(messages) - 1:
            return ids
        ids += [IM_END, *encode_text("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode_text("assistant\n")]
    return ids


class AgentFakeVLLM(FakeVLLM):
    """See the module docstring."""

    def __init__(self, base_url: str = "http://vllm-0.test", **options: Any) -> None:
        super().__init__(base_url, max_model_len=4096, **options)
        self.merge_ok = False
        self.script: Callable[[str, int], str] | None = None
        self.generations = 0
        self.replies: list[dict[str, Any]] = []
        """Every generation reply body, in order (what the server said)."""

    def _tokenize(self, body: dict[str, Any]) -> httpx.Response:
        if "messages" in body:
            ids = render(body["messages"], tools=body.get("tools"),
                         add_generation_prompt=body.get("add_generation_prompt", True),
                         continue_final_message=body.get("continue_final_message", False))
        else:
            ids = encode_text(body["prompt"])
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    def _reply_ids(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        number = self.generations
        self.generations += 1
        text = self.script(decode(prompt_ids), number) if self.script else f"reply {number}"
        ids: list[int] = []
        rest = text
        while rest:
            if self.merge_ok and rest.startswith("ok"):
                ids.append(PAIR)
                rest = rest[2:]
            else:
                ids += encode_text(rest[0])
                rest = rest[1:]
        ids.append(EOS)
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    async def _generate(self, path: str, body: dict[str, Any]) -> httpx.Response:
        if body.get("model") != self.model:
            return _json({"error": {"message": "no such model", "type": "NotFoundError",
                                    "param": "model", "code": 404}}, 404)
        chat = path.endswith("chat/completions")
        if chat:
            prompt_ids = render(body["messages"], tools=body.get("tools"))
        else:
            prompt = body["prompt"]
            prompt_ids = prompt if isinstance(prompt, list) else encode_text(prompt)
        if len(prompt_ids) >= self.max_model_len:
            return _json({"error": {"message": "prompt too long", "type": "BadRequestError",
                                    "param": "input_tokens", "code": 400}}, 400)
        budget = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
        ids, finish = self._reply_ids(prompt_ids, budget or 64)  # vLLM's chat precedence
        text = decode([i for i in ids if i != EOS])
        logprobs = [logprob_of(t, 0) for t in ids]
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning": None}
            if body.get("tools") and body.get("tool_choice") != "none":
                content, calls = parse_hermes(text)
                message.update(content=content, tool_calls=calls)
                finish = "tool_calls" if calls else finish
            reply: dict[str, Any] = {
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 1,
                "model": self.model, "usage": usage, "prompt_token_ids": prompt_ids,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                                      for t, lp in zip(ids, logprobs,
                                                                       strict=True)]},
                             "stop_reason": None, "token_ids": ids}]}
        else:
            reply = {"id": "cmpl-fake", "object": "text_completion", "created": 1,
                     "model": self.model, "usage": usage,
                     "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                  "logprobs": {"token_logprobs": logprobs,
                                               "tokens": [f"token_id:{t}" for t in ids]},
                                  "stop_reason": None, "token_ids": ids,
                                  "prompt_token_ids": prompt_ids}]}
        self.replies.append(reply)
        return _json(reply)


def _json(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, content=orjson.dumps(body),
                          headers={"content-type": "application/json"})
