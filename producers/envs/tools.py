"""``tools``: a tool-use task, arithmetic questions answered with a calculator the agent runs.

The agent is an ordinary ``openai``-package agent (``CalculatorAgent``, AReaL's workflow
shape ``run(data, base_url=, http_client=, api_key=)``): it asks ``What is 7 - 3?`` with one
tool, ``calc`` (``{"expression": "7 - 3"}``); when the reply calls it, the agent evaluates the
expression (``calculate``), appends the ``tool`` message and asks again; the second reply is
the final answer, a bare number. The model never sees the result unless it calls the tool,
and it has to copy the tool's result into its answer to be right.

Reward (the episode's return, ``env_score``): 1.0 when the episode called ``calc`` and the
final answer is the record's ``answer``; else 0.0 (no call, a malformed call, a second call
instead of an answer, or a wrong number). Data: the shipped ``producers/data/calc.jsonl``
(``producers.data.make_calc``): the 152 questions ``a op b`` (a, b in 0..9, op ``+ - *``)
whose result is one digit, 122 for training and 30 held out; a uniform guess over the 10
digits is right with probability ``CHANCE`` (1/10).

The served model needs a chat template that renders tools, tool calls and ``tool`` messages
(``TOOLS_CHAT_TEMPLATE``: ChatML with Hermes ``<tool_call>`` blocks) and vLLM started with
``--enable-auto-tool-choice --tool-call-parser hermes`` (``VLLM_TOOL_FLAGS``), so that the
model's ``<tool_call>{json}</tool_call>`` text comes back as ``tool_calls``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import openai

from rollq.producers.envs.episode import GatewayEpisodeEnv
from rollq.producers.envs.sums import Split, split_records
from rollq.producers.inference.capture import RemoteGateway
from rollq.producers.inference.capture.gateways import default_ssl_context

__all__ = ["CALC_TOOL", "CHANCE", "TOOLS_CHAT_TEMPLATE", "VLLM_TOOL_FLAGS", "CalculatorAgent",
           "EpisodeOutcome", "calc_records", "calculate", "tools_env"]

CHANCE = 1 / 10
"""Accuracy of an answer drawn uniformly from the 10 digits (every ``calc.jsonl`` answer is
one)."""

CALC_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression (+, -, * on integers).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

VLLM_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
"""The vLLM server flags that turn the model's ``<tool_call>`` text into ``tool_calls``."""

TOOLS_CHAT_TEMPLATE = resources.files("rollq.producers.data").joinpath(
    "tools_chat_template.jinja").read_text()
"""ChatML with tools: a ``system`` line naming the tools, assistant tool calls as Hermes
``<tool_call>`` blocks (what vLLM's ``hermes`` parser reads back), ``tool`` turns
(``producers/data/tools_chat_template.jinja``)."""

_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_INTEGER = re.compile(r"-?[0-9]+")


def calculate(expression: str) -> str:
    """The ``calc`` tool: ``+ - *`` over integers, the result as decimal text; ``error``
    for anything else (the model sees that as the tool's answer, as from a real tool)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(expression)

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def final_answer(content: str | None) -> int | None:
    """The final reply as a number: the whole reply (spaces aside) must be one integer."""
    text = (content or "").strip()
    return int(text) if _INTEGER.fullmatch(text) else None


@dataclass
class EpisodeOutcome:
    """What one episode did: ``called`` (the first reply called ``calc`` with an
    expression), ``answer`` (the final reply as a number, None when it is not one),
    ``correct`` (called and the answer is the record's), ``failure`` (why the episode is not
    well formed: ``no call``, ``tool error``, ``called again``, ``no number``; None when it is)."""

    called: bool = False
    answer: int | None = None
    correct: bool = False
    failure: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CalculatorAgent:
    """The agent (module docstring), written as for any OpenAI-compatible server.

    ``max_tokens``: per call; ``temperature``: None leaves it to the server (through rollq:
    the worker's sampling), 0 for greedy evaluation.
    """

    max_tokens: int = 80
    temperature: float | None = None
    model: str = "rollq-tiny"

    async def run(self, data: dict[str, Any], *, base_url: str,
                  http_client: Any = None, api_key: str = "", **extra: Any) -> float:
        """AReaL's workflow call: the episode's reward. ``http_client``: an
        ``httpx.AsyncClient`` or None (typed Any: openai's stubs name their own httpx)."""
        if http_client is None:  # openai's own client, but not a CA bundle read per episode
            http_client = openai.DefaultAsyncHttpxClient(verify=default_ssl_context())
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none",
                                      http_client=http_client, max_retries=0) as client:
            outcome = await self.episode(client, data)
        return 1.0 if outcome.correct else 0.0

    async def episode(self, client: openai.AsyncOpenAI, data: dict[str, Any]) -> EpisodeOutcome:
        """Ask, run the ``calc`` call, ask again for the answer (module docstring)."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(data["problem"])}]
        outcome = EpisodeOutcome(messages=messages)
        reply = await self._ask(client, messages)
        calls = reply.tool_calls or []
        messages.append(reply.model_dump(exclude_none=True))
        if not calls:
            outcome.failure = "no call"
            return outcome
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": self._run_tool(call.function.name,
                                                       call.function.arguments)})
        outcome.called = all(m["content"] != "error" for m in messages[2:])
        reply = await self._ask(client, messages)
        messages.append(reply.model_dump(exclude_none=True))
        if reply.tool_calls:
            outcome.failure = "called again"
            return outcome
        outcome.answer = final_answer(reply.content)
        outcome.correct = outcome.called and outcome.answer == int(data["answer"])
        if not outcome.called:
            outcome.failure = "tool error"
        elif outcome.answer is None:
            outcome.failure = "no number"
        return outcome

    async def _ask(self, client: openai.AsyncOpenAI,
                   messages: list[dict[str, Any]]) -> Any:
        sampling: dict[str, Any] = {} if self.temperature is None else {
            "temperature": self.temperature}
        response = await client.chat.completions.create(
            model=self.model, messages=messages,  # type: ignore[arg-type]  # plain dicts
            tools=[CALC_TOOL], max_tokens=self.max_tokens, **sampling)  # type: ignore[list-item]
        return response.choices[0].message

    @staticmethod
    def _run_tool(name: str, arguments: str) -> str:
        """The tool's answer to one call: ``error`` for another tool or bad arguments."""
        try:
            expression = json.loads(arguments).get("expression") if name == "calc" else None
        except (ValueError, AttributeError):
            expression = None
        return calculate(expression) if isinstance(expression, str) else "error"


def calc_records(split: Split = "train", source: str | Path | None = None,
                 ) -> list[dict[str, Any]]:
    """The questions of ``split`` (``train``: 122, ``heldout``: 30, ``all``: 152), file order.
    ``source``: a JSONL file of your own, records with ``problem``, ``expression`` (what the
    warm start calls ``calc`` with), ``answer`` and ``split``."""
    shipped = resources.files("rollq.producers.data").joinpath("calc.jsonl")
    return split_records("tools", source or str(shipped), split)


def tools_env(*, gateway: str | None = None, split: Split = "train",
              source: str | Path | None = None, max_tokens: int = 80) -> GatewayEpisodeEnv:
    """The ``tools`` env: ``CalculatorAgent`` on the questions of ``split``, each episode on
    its own captured base URL: a ``rollq gateway`` at ``gateway``, or (None) the worker's
    in-process one."""
    remote = None if gateway is None else RemoteGateway(gateway)
    return GatewayEpisodeEnv("tools", CalculatorAgent(max_tokens=max_tokens),
                             calc_records(split, source), gateway=remote)

