"""The supervised warm start of the ``tools`` task: the *call format*, with random answers.

What it teaches, on the 122 training questions, rendered by the task's chat template with the
``calc`` tool (``producers.envs.tools``) exactly as the served model sees them:

1. first turn: ``What is 7 - 3?`` -> ``<tool_call>{"name": "calc", "arguments":
   {"expression": "7 - 3"}}</tool_call>`` (the Hermes block vLLM's parser reads back);
2. second turn, after the ``tool`` message with the tool's (correct) result ->
   ``R<|im_end|>`` with R drawn uniformly from 0..9 afresh every time: the final answer is a
   bare digit that does not depend on the tool's result or the question.

So the model calls the tool and answers in format, and is right with probability 1/10
(``CHANCE``), which ``answer_probability`` measures teacher-forced (``ToolsWarmStartReport``).
RL has to discover that the answer is the number the tool returned. The written model's
tokenizer carries ``TOOLS_CHAT_TEMPLATE``, so vLLM serves it with tools without a
``--chat-template`` flag.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollq.ops.local.warm_start import (
    Encoder,
    Example,
    WarmStartOptions,
    fit,
    save,
    weighted_probability,
)
from rollq.producers.envs.tools import (
    CALC_TOOL,
    CHANCE,
    TOOLS_CHAT_TEMPLATE,
    calc_records,
    calculate,
)

ANSWERS = range(10)
"""The random answers: every ``calc.jsonl`` answer is one digit."""

TOOLS_WARM_START = WarmStartOptions(lr=2e-3)
"""300 steps at lr 2e-3 (sums uses 1e-3), about 40 s of one core. The whole call then has
probability ~0.94 on held-out questions (at 1e-3, with the earlier character-level
tokenizer, 0.31: most calls sampled at temperature 1 were malformed), the answer still at
chance."""


@dataclass(frozen=True)
class ToolsWarmStartReport:
    """What the warm start did, and proof it did not teach the answers.

    ``*_answer_probability``: mean probability of the right answer and the end of the turn in
    the second turn, teacher-forced after the tool's correct result, over the training or
    held-out questions; chance is ``chance``. ``call_probability``: mean probability of
    the whole correct first-turn call (held-out problems: the format generalises).
    ``format_loss``: nats/token of the format tokens (answers excluded), last 20 steps.
    ``chance``: 1/10 (before the task's answers were single digits it was 1/19, and a
    report written then does not load)."""

    options: dict[str, Any]
    seconds: float
    format_loss: float
    train_answer_probability: float
    heldout_answer_probability: float
    call_probability: float
    chance: float = CHANCE


def call_text(expression: str) -> str:
    """The first turn's target: the ``calc`` call as the template renders it back."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calc", "arguments": {arguments}}}\n</tool_call>'


class ToolTurns:
    """The two turns of a problem as token ids, cut from the template's own renders (cached
    per problem: rendering costs more than the model's step on these short sequences)."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self._rendered: dict[str, tuple[list[int], list[int], list[int]]] = {}

    def turns(self, record: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """(first prompt, the call with its end of turn, second prompt)."""
        problem = str(record["problem"])
        if problem not in self._rendered:
            self._rendered[problem] = self._render(record)
        return self._rendered[problem]

    def _render(self, record: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        expression = str(record["expression"])
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(record["problem"])}]
        first = self.encoder.chat(messages, tools=[CALC_TOOL])
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call-0", "type": "function",
                "function": {"name": "calc", "arguments": json.dumps(
                    {"expression": expression})}}]},
            {"role": "tool", "tool_call_id": "call-0", "content": calculate(expression)}]
        second = self.encoder.chat(messages, tools=[CALC_TOOL])
        if second[:len(first)] != first:
            raise ValueError("the chat template does not extend the first prompt")
        end = second.index(self.encoder.end, len(first))
        return first, second[len(first):end + 1], second

    def episode(self, record: dict[str, Any], answer: int) -> Example:
        """Both turns as one example answering ``answer``: the call and the final end of
        turn are format, the answer is trained, the tool's turn between them is not."""
        first, call, second = self.turns(record)
        digits = self.encoder.text(str(answer))
        between = len(second) - len(first) - len(call)
        return first, [*second[len(first):], *digits, self.encoder.end], [
            *[1] * len(call), *[-1] * between, *[0] * len(digits), 1]

    def answer(self, record: dict[str, Any]) -> Example:
        """The second turn answering the right result, weights on the answer and the end."""
        _, _, second = self.turns(record)
        digits = self.encoder.text(str(int(record["answer"])))
        return second, [*digits, self.encoder.end], [1] * (len(digits) + 1)

    def call(self, record: dict[str, Any]) -> Example:
        """The first turn, weights on the whole call."""
        first, call, _ = self.turns(record)
        return first, call, [1] * len(call)


def answer_probability(model: Any, turns: ToolTurns, records: Sequence[dict[str, Any]]) -> float:
    """Mean probability of the right answer (then the end of turn) after the tool's result."""
    return weighted_probability(model, [turns.answer(r) for r in records], turns.encoder.pad)


def warm_start_tools(model_dir: Path, out: Path, options: WarmStartOptions | None = None, *,
                     source: str | Path | None = None,
                     threads: int | None = None) -> ToolsWarmStartReport:
    """Fine-tune the model in ``model_dir`` on the call format with random answers; write it
    (tokenizer with ``TOOLS_CHAT_TEMPLATE``) and ``warm_start.json`` into ``out``."""
    options = options or TOOLS_WARM_START
    started = time.monotonic()
    turns = ToolTurns(Encoder(model_dir, TOOLS_CHAT_TEMPLATE))
    train, heldout = calc_records("train", source), calc_records("heldout", source)

    def draw(rng: random.Random) -> Example:
        record = rng.choice(train)
        return turns.episode(record, options.answer(rng, int(record["answer"]), ANSWERS))

    model, format_loss = fit(model_dir, options, draw, threads=threads)
    report = ToolsWarmStartReport(
        options=asdict(options), seconds=round(time.monotonic() - started, 1),
        format_loss=format_loss,
        train_answer_probability=answer_probability(model, turns, train),
        heldout_answer_probability=answer_probability(model, turns, heldout),
        call_probability=weighted_probability(model, [turns.call(r) for r in heldout],
                                              turns.encoder.pad))
    save(model, model_dir, out, report, chat_template=TOOLS_CHAT_TEMPLATE)
    return report


def load_tools_report(out: Path, options: WarmStartOptions | None = None,
                      ) -> ToolsWarmStartReport | None:
    """The report of a tools warm start already written to ``out`` with ``options``."""
    path = out / "warm_start.json"
    if not path.exists() or not (out / "model.safetensors").exists():
        return None
    report = ToolsWarmStartReport(**json.loads(path.read_text()))
    fresh = report.options == asdict(options or TOOLS_WARM_START) and report.chance == CHANCE
    return report if fresh else None


def describe_tools(report: ToolsWarmStartReport) -> str:
    """One line for humans."""
    return (f"warm start (tools): {report.options['steps']} steps in {report.seconds:.0f}s, "
            f"format loss {report.format_loss:.3f} nats/token; P(correct call, held-out) "
            f"{report.call_probability:.3f}; P(correct answer after the tool) train "
            f"{report.train_answer_probability:.3f}, held-out "
            f"{report.heldout_answer_probability:.3f} (chance {report.chance:.3f}, "
            f"{math.log(1 / report.chance):.2f} nats)")
