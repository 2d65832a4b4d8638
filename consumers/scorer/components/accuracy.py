"""Correctness against the env's gold answer: math (math-verify) and GSM8K (`#### N`)."""

from __future__ import annotations

import functools
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from rollq.consumers.scorer.components.base import ComponentSettings, Placement, RewardComponent
from rollq.consumers.scorer.sample import Sample


class AccuracySettings(ComponentSettings):
    """Settings of `accuracy`.

    - `kind`: `math` compares with math-verify (sympy; runs in the process pool);
      `gsm8k` compares the number after the last `####` (or in the last `\\boxed{}`)
      with the gold `#### N`, commas and `$` stripped (cheap; runs inline).
    - `gold_field`: the metadata field holding the gold answer (per completion first, then
      per group). A group without it is not scored (`MissingFieldError`).
    - `on_unparseable_gold`: gold that does not parse gives `skip` (None: the component
      adds nothing, as TRL/open-r1 accuracy), `zero` (0.0) or `correct` (1.0).
    - `answer_region`: `whole` reads the whole completion (open-r1 accuracy); `answer`
      reads only the text after the reasoning trace and scores 0.0 when the trace has no
      closing delimiter (TRL `reasoning_accuracy`).
    - `plain_answers` (math): also read an answer written as plain text or a bare
      expression (`The answer is 7.`, `3 + 4 = 7`: math-verify's `ExprExtractionConfig`
      beside the LaTeX one), as an instruct model replies when not asked for `\\boxed{}`;
      off, only LaTeX answers count (`\\boxed{7}`, `$7$`: open-r1's accuracy).
    - `parsing_timeout_s`, `verify_timeout_s`: math-verify's own signal-based timeouts
      (whole seconds; None disables them). They only work in a main thread, which a pool
      worker is; the bridge's per-call `timeout_s` is the hard limit either way.
    """

    kind: Literal["math", "gsm8k"] = "math"
    gold_field: str = "answer"
    on_unparseable_gold: Literal["skip", "zero", "correct"] = "skip"
    answer_region: Literal["whole", "answer"] = "whole"
    plain_answers: bool = False
    parsing_timeout_s: int | None = Field(default=5, ge=1)
    verify_timeout_s: int | None = Field(default=5, ge=1)


_UNPARSEABLE = {"skip": None, "zero": 0.0, "correct": 1.0}
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_BOXED = "\\boxed{"


def _boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None if there is none."""
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth = 1
    index = start + len(_BOXED)
    for position in range(index, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[index:position]
    return None


def parse_gsm8k_number(text: str) -> float | None:
    """The number after the last `####` (else in the last `\\boxed{}`), commas and `$`
    stripped; None when there is none."""
    if "####" in text:
        candidate: str | None = text.rsplit("####", 1)[1]
    else:
        candidate = _boxed_content(text)
    if candidate is None:
        return None
    match = _NUMBER.search(candidate.replace(",", "").replace("$", ""))
    return float(match.group()) if match else None


class Accuracy(RewardComponent[AccuracySettings]):
    """1.0 when the completion's answer equals the gold, else 0.0 (see `AccuracySettings`).

    math: gold = `parse(gold)`; answer = `parse(completion, [LatexExtractionConfig(
    normalization: units, basic_latex, equations, boxed="all"; boxed_match_priority=0;
    try_extract_without_anchor=False)], extraction_mode="first_match")`;
    gold is parsed with `extraction_mode="first_match"`; value =
    `float(verify(gold, answer))` (open-r1).
    """

    settings_model = AccuracySettings
    preload_modules = ("math_verify",)

    @property
    def placement(self) -> Placement:
        return "process" if self.settings.kind == "math" else "inline"

    def required_fields(self) -> tuple[str, ...]:
        return (self.settings.gold_field,)

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        settings = self.settings
        if settings.answer_region == "answer":
            if not sample.trace.closed:
                return 0.0
            text = sample.region_text("answer")
        else:
            text = sample.region_text("anywhere")
        gold = str(sample.lookup(settings.gold_field))
        if settings.kind == "gsm8k":
            return self._score_gsm8k(text, gold)
        return self._score_math(text, gold)

    def _score_gsm8k(self, text: str, gold: str) -> float | None:
        gold_number = parse_gsm8k_number(gold if "####" in gold else "####" + gold)
        if gold_number is None:
            return _UNPARSEABLE[self.settings.on_unparseable_gold]
        answer = parse_gsm8k_number(text)
        if answer is None:
            return 0.0
        return float(math.isclose(answer, gold_number, rel_tol=1e-9, abs_tol=1e-9))

    def _score_math(self, text: str, gold: str) -> float | None:
        # Imported here: math-verify pulls in sympy, which only pool workers need.
        from math_verify import parse, verify

        timeout = self.settings.parsing_timeout_s
        gold_parsed = _parsed_gold(gold, timeout)
        if len(gold_parsed) == 0:
            return _UNPARSEABLE[self.settings.on_unparseable_gold]
        answer = parse(text, extraction_config=_answer_extraction(self.settings.plain_answers),
                       extraction_mode="first_match", parsing_timeout=timeout)
        return float(verify(gold_parsed, answer, timeout_seconds=self.settings.verify_timeout_s))


_GOLDS_KEPT = 1024
"""Parsed gold answers one process keeps, least recently used dropped first."""
_parsed_golds: OrderedDict[tuple[str, int | None], list[Any]] = OrderedDict()


def _parsed_gold(gold: str, timeout: int | None) -> list[Any]:
    """``parse(gold)``, remembered: every completion of a group is checked against the same
    gold, and parsing it cost almost as much as parsing the completion (0.25-0.45 ms against
    0.34-0.48, ``bench.scorer``'s MATH-like texts; math-verify's own caches keep 20 LaTeX
    strings, and its extraction still runs on every call). An empty result (no answer
    found, or a parse that hit its timeout) is not kept: the next completion tries again.
    A copy of the list is returned; the sympy values in it are immutable."""
    from math_verify import parse

    key = (gold, timeout)
    parsed = _parsed_golds.get(key)
    if parsed is not None:
        _parsed_golds.move_to_end(key)
        return list(parsed)
    parsed = parse(gold, extraction_mode="first_match", parsing_timeout=timeout)
    if parsed:
        _parsed_golds[key] = parsed
        if len(_parsed_golds) > _GOLDS_KEPT:
            _parsed_golds.popitem(last=False)
    return list(parsed)


@functools.cache
def _answer_extraction(plain_answers: bool = False) -> tuple[Any, ...]:
    """open-r1's extraction settings for the completion (built once: building them logs a
    deprecation notice each time, for ``equations=True``); with ``plain_answers``,
    math-verify's plain-expression extraction beside them."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, LatexNormalizationConfig

    latex = LatexExtractionConfig(
        normalization_config=LatexNormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True,
            equations=True, boxed="all", units=True,
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return (latex, ExprExtractionConfig()) if plain_answers else (latex,)
