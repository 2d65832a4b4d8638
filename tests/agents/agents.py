"""Agents for the tests: a calculator agent written for the ``openai`` client, run through
the episode API and, unchanged, through the gateway; a context-rewriting agent; a text
(``/v1/completions``) agent."""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from typing import Any

import httpx
import openai

from rollq.producers.envs.base import EpisodeResult, Item
from rollq.producers.inference import SamplingParams

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
QUESTIONS = ["What is 6*7?", "What is (2+3)*4?", "What is 9-4?"]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: + - * / over numbers; ``error`` for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(expression)

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error"
    return f"{result:g}"


TurnOptions = Callable[[int], dict[str, Any]]
"""The request fields an agent adds on turn ``i`` (``tool_choice``, ``seed``, ``stop``…)."""


async def calculator_episode(client: Any, question: str, *, max_calls: int = 4,
                             scripted_tool_turns: int = 2, max_tokens: int = 96,
                             options: TurnOptions | None = None,
                             model: str = "any-model") -> float:
    """The agent: asks with the calculator tool, runs the tool calls the model makes and
    appends ``tool`` messages; when the model makes none (a tiny random model never does),
    its script calls the tool itself for the first ``scripted_tool_turns`` turns, so every
    episode has 2..4 calls. Reward 1 when the last reply holds the tool's last result.
    ``options(turn)``: the request's fields beyond messages and tools (default:
    ``max_tokens``)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the calculator for arithmetic."},
        {"role": "user", "content": question}]
    last_result = "?"
    content = ""
    for turn in range(max_calls):
        fields = options(turn) if options is not None else {"max_tokens": max_tokens}
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], **fields)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        calls = message.tool_calls or []
        for call in calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            last_result = calculate(str(expression))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": last_result})
        if not calls:
            if turn >= scripted_tool_turns or turn == max_calls - 1:
                break
            last_result = calculate(question.removeprefix("What is ").rstrip("?"))
            messages.append({"role": "tool", "tool_call_id": f"scripted-{turn}",
                             "content": last_result})
    return 1.0 if last_result in content else 0.0


class CalculatorEnv:
    """An ``AgentEnv``: the calculator agent on the episode API."""

    name = "calculator"

    def __init__(self, scripted_tool_turns: int = 2, max_tokens: int = 96,
                 options: TurnOptions | None = None) -> None:
        self.scripted_tool_turns = scripted_tool_turns
        self.max_tokens = max_tokens
        self.options = options

    def __len__(self) -> int:
        return len(QUESTIONS)

    def item(self, index: int) -> Item:
        return Item(index=index, fields={"question": QUESTIONS[index], "answer": "42"})

    async def run_episode(self, client: Any, item: Item, *,
                          sampling: SamplingParams) -> EpisodeResult:
        reward = await calculator_episode(client, item.fields["question"],
                                          scripted_tool_turns=self.scripted_tool_turns,
                                          max_tokens=self.max_tokens, options=self.options)
        return EpisodeResult(reward=reward, metadata={"question": item.fields["question"]})


class CalculatorWorkflow:
    """The same agent as an AReaL-style workflow: its own ``openai.AsyncOpenAI`` on the
    base URL it is given (and the http client, when there is one and ``use_http_client``:
    AReaL documents the client as optional, and many agents ignore it)."""

    def __init__(self, scripted_tool_turns: int = 2, max_tokens: int = 96,
                 options: TurnOptions | None = None, use_http_client: bool = True,
                 model: str = "any-model") -> None:
        self.scripted_tool_turns = scripted_tool_turns
        self.model = model
        self.max_tokens = max_tokens
        self.options = options
        self.use_http_client = use_http_client
        self.runs = 0
        """Episodes started (a test counts the tries of a job by it)."""

    async def run(self, data: dict[str, Any], *, base_url: str,
                  http_client: httpx.AsyncClient | None = None, api_key: str = "",
                  **extra: Any) -> float:
        self.runs += 1
        own = http_client if self.use_http_client else None
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none",
                                      http_client=own, max_retries=0) as client:
            return await calculator_episode(client, data["question"],
                                            scripted_tool_turns=self.scripted_tool_turns,
                                            max_tokens=self.max_tokens, options=self.options,
                                            model=self.model)


class RewritingEnv:
    """An ``AgentEnv`` that rewrites its context: two calls in one conversation, then a
    summary replaces it and two more calls follow (two sequences per episode)."""

    name = "rewriting"

    def __len__(self) -> int:
        return 1

    def item(self, index: int) -> Item:
        return Item(index=index, fields={"task": "count"})

    async def run_episode(self, client: Any, item: Item, *, sampling: SamplingParams) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me."}]
        for _ in range(2):
            reply = await client.chat.completions.create(messages=messages, max_tokens=16)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "next"}]
        messages = [{"role": "user", "content": f"Summary: {len(messages)} messages so far."}]
        for _ in range(2):
            reply = await client.chat.completions.create(messages=messages, max_tokens=16)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]
        return 0.5


class TextEnv:
    """An ``AgentEnv`` on ``/v1/completions``: it concatenates prompt text and replies."""

    name = "text"

    def __len__(self) -> int:
        return 1

    def item(self, index: int) -> Item:
        return Item(index=index, fields={})

    async def run_episode(self, client: Any, item: Item, *, sampling: SamplingParams) -> None:
        prompt = "Q: 2+3?\nA:"
        for turn in range(3):
            reply = await client.completions.create(prompt=prompt, max_tokens=16)
            prompt += reply.choices[0].text + f"\nObservation {turn}\nA:"
