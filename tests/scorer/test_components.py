"""Component semantics (REWARDS.md), on hand-computed cases and the edge cases it names."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from rollq.consumers.scorer.components import (
    Accuracy,
    AccuracySettings,
    Cosine,
    CosineSettings,
    Format,
    FormatMarkers,
    FormatMarkersSettings,
    FormatSettings,
    KimiLength,
    KimiLengthSettings,
    LengthBounty,
    LengthBountySettings,
    ReasoningSteps,
    ReasoningStepsSettings,
    Repetition,
    RepetitionSettings,
    SoftOverlong,
    SoftOverlongSettings,
    TagCount,
    TagCountSettings,
)
from rollq.consumers.scorer.sample import Sample
from tests.scorer.helpers import make_sample

R1_TEXT = "<think>\nabc\n</think>\n<answer>\n42\n</answer>"


def score_accuracy(text: str, gold: str, **settings: Any) -> float | None:
    component = Accuracy(AccuracySettings(**settings))
    sample = make_sample(text, metadata={"answer": gold})
    return component.score(sample, [sample])


# --- accuracy (math) ------------------------------------------------------------------

@pytest.mark.parametrize(("text", "gold", "expected"), [
    ("<think>x</think> so the answer is $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    ("the answer is \\boxed{0.5}", "$\\frac{1}{2}$", 1.0),
    ("the answer is \\boxed{3}", "$\\frac{1}{2}$", 0.0),
    ("no math at all", "$2$", 0.0),
])
def test_math_accuracy(text: str, gold: str, expected: float) -> None:
    assert score_accuracy(text, gold, kind="math") == expected


@pytest.mark.parametrize(("policy", "expected"), [("skip", None), ("zero", 0.0),
                                                   ("correct", 1.0)])
@pytest.mark.parametrize("kind", ["math", "gsm8k"])
def test_unparseable_gold_follows_policy(kind: str, policy: str, expected: float | None) -> None:
    gold = "no number here" if kind == "gsm8k" else "hello there"
    assert score_accuracy("\\boxed{2} #### 2", gold, kind=kind,
                          on_unparseable_gold=policy) == expected


@pytest.mark.parametrize(("text", "expected", "plain"), [
    ("The answer is 7.", 0.0, 1.0),
    ("3 + 4 = 7", 0.0, 1.0),
    ("7", 0.0, 1.0),
    ("The sum of 3 and 4 is 8. In mathematics", 0.0, 0.0),
    ("so \\boxed{7}", 1.0, 1.0),
])
def test_math_reads_plain_answers_only_when_asked(text: str, expected: float,
                                                  plain: float) -> None:
    """An instruct model's own replies (SmolLM2's sums): LaTeX-only extraction reads none
    of them, ``plain_answers`` reads the first answer."""
    assert score_accuracy(text, "\\boxed{7}", kind="math") == expected
    assert score_accuracy(text, "\\boxed{7}", kind="math", plain_answers=True) == plain


def test_math_answer_region_needs_closing_delimiter() -> None:
    unclosed = "<think>I think it is \\boxed{2}"
    assert score_accuracy(unclosed, "$2$", kind="math", answer_region="whole") == 1.0
    assert score_accuracy(unclosed, "$2$", kind="math", answer_region="answer") == 0.0
    # The answer region excludes the reasoning: a boxed guess inside it does not count.
    closed = "<think>maybe \\boxed{2}</think> it is \\boxed{3}"
    assert score_accuracy(closed, "$2$", kind="math", answer_region="answer") == 0.0
    assert score_accuracy(closed, "$3$", kind="math", answer_region="answer") == 1.0


def test_a_gold_is_parsed_once_for_all_completions_checked_against_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    parsed: list[str] = []
    real_parse = math_verify.parse

    def counting_parse(pred: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(pred)
        return real_parse(pred, *args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", counting_parse)
    gold = "$\\frac{7}{13}$"  # used by no other test: the memo lives as long as the process
    texts = ["so \\boxed{\\frac{7}{13}}", "so \\boxed{\\frac{14}{26}}", "so \\boxed{7}"]
    assert [score_accuracy(text, gold, kind="math") for text in texts] == [1.0, 1.0, 0.0]
    assert parsed.count(gold) == 1
    assert [pred for pred in parsed if pred != gold] == texts  # every completion is parsed
    # A gold that does not parse is not remembered as unparseable: it is tried each time.
    for _ in range(2):
        assert score_accuracy("so \\boxed{2}", "no answer in here", kind="math") is None
    assert parsed.count("no answer in here") == 2


# --- accuracy (gsm8k) -----------------------------------------------------------------

@pytest.mark.parametrize(("text", "gold", "expected"), [
    ("so #### 1,000", "#### 1000", 1.0),
    ("so #### $1,000.00", "#### 1,000", 1.0),
    ("so #### 72.", "#### 72", 1.0),
    ("so \\boxed{72}", "#### 72", 1.0),
    ("#### 5 wait, no #### 72", "#### 72", 1.0),
    ("#### 71", "#### 72", 0.0),
    ("no final answer", "#### 72", 0.0),
    ("#### -3", "#### -3", 1.0),
    ("#### 72", "72", 1.0),
])
def test_gsm8k_accuracy(text: str, gold: str, expected: float) -> None:
    assert score_accuracy(text, gold, kind="gsm8k") == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>#### 72", 0.0),                # no closing delimiter -> 0 (TRL reasoning_accuracy)
    ("#### 72", 0.0),                       # no tags at all: no closing delimiter either
    ("<think>hmm</think>#### 72", 1.0),
    ("<think>#### 72</think>#### 5", 0.0),  # the reasoning's answer does not count
])
def test_gsm8k_reasoning_accuracy_region(text: str, expected: float) -> None:
    assert score_accuracy(text, "#### 72", kind="gsm8k", answer_region="answer") == expected


# --- format ---------------------------------------------------------------------------

@pytest.mark.parametrize(("preset", "text", "expected"), [
    ("r1", R1_TEXT, 1.0),
    ("r1", "<think>abc</think><answer>42</answer>", 0.0),
    ("r1", "<think>\nabc\n</think>\n42", 0.0),
    ("think", "<think>a</think>b", 1.0),
    ("think", "<think>a<think>b</think>", 0.0),
    ("think", "x<think>a</think>", 0.0),
    ("think", "<think>a", 0.0),
])
def test_format_presets(preset: str, text: str, expected: float) -> None:
    assert Format(FormatSettings(preset=preset)).score(make_sample(text), []) == expected


def test_format_custom_pattern_and_flags() -> None:
    sample = make_sample("ANSWER: 4")
    assert Format(FormatSettings(pattern=r"answer: \d")).score(sample, []) == 0.0
    insensitive = FormatSettings(pattern=r"answer: \d", flags=("IGNORECASE",))
    assert Format(insensitive).score(sample, []) == 1.0


def test_format_needs_exactly_one_of_preset_and_pattern() -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        FormatSettings(preset="r1", pattern="x")
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        FormatSettings()


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>x</think> \\boxed{2}", 0.5),
    ("\\boxed{2}", 0.3),
    ("<think> twice <think>", 0.2),  # a marker counts once
    ("plain", 0.0),
])
def test_format_markers_default_roll_bonuses(text: str, expected: float) -> None:
    component = FormatMarkers(FormatMarkersSettings())
    assert component.score(make_sample(text), []) == pytest.approx(expected)


def test_format_markers_regions() -> None:
    settings = FormatMarkersSettings.model_validate({"markers": [
        {"marker": "\\boxed{", "reward": 0.3, "region": "answer"},
        {"marker": "wait", "reward": 0.1, "region": "reasoning"},
    ]})
    component = FormatMarkers(settings)
    assert component.score(make_sample("<think>wait \\boxed{1}</think> 1"), []) == 0.1
    assert component.score(make_sample("<think>ok</think> \\boxed{1} wait"), []) == 0.3


@pytest.mark.parametrize(("text", "expected"), [
    (R1_TEXT, 1.0),
    ("<think>\nabc\n</think>\n", 0.5),
    ("<think>\n<think>\nabc\n</think>\n<answer>\n42\n</answer>", 0.75),
    ("", 0.0),
])
def test_tag_count(text: str, expected: float) -> None:
    assert TagCount(TagCountSettings()).score(make_sample(text), []) == expected


def test_tag_count_configurable_checks() -> None:
    component = TagCount(TagCountSettings(checks=("<a>", "</a>")))
    assert component.score(make_sample("<a>x"), []) == 0.5


# --- length ---------------------------------------------------------------------------

@pytest.mark.parametrize(("unit", "chars", "tokens", "expected"), [
    ("chars", 100, 7, 0.1),
    ("chars", 5000, 7, 0.2),
    ("tokens", 3000, 150, 0.15),
])
def test_length_bounty(unit: str, chars: int, tokens: int, expected: float) -> None:
    component = LengthBounty(LengthBountySettings(unit=unit))
    assert component.score(make_sample("x" * chars, tokens=tokens), []) == pytest.approx(expected)


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, 0.0), (80, 0.0),       # L = Lmax - C exactly: still no penalty
    (81, -0.05), (90, -0.5),
    (100, -1.0),               # L = Lmax exactly: the ramp's end
    (101, -1.0), (500, -1.0),
])
def test_soft_overlong(tokens: int, expected: float) -> None:
    component = SoftOverlong(SoftOverlongSettings(max_completion_len=100, cache=20))
    assert component.score(make_sample("x", tokens=tokens), []) == pytest.approx(expected)


def test_soft_overlong_cache_must_fit() -> None:
    with pytest.raises(pydantic.ValidationError, match="cache"):
        SoftOverlongSettings(max_completion_len=10, cache=20)


def judged(text: str, correct: bool | None, tokens: int | None = None) -> Sample:
    sample = make_sample(text, tokens=tokens)
    return Sample(**{**sample.__dict__, "correct": correct})


@pytest.mark.parametrize(("correct", "length", "clamp", "expected"), [
    (True, 0, False, 1.0), (True, 50, False, 0.75), (True, 100, False, 0.5),
    (False, 0, False, -1.0), (False, 50, False, -0.75), (False, 100, False, -0.5),
    # Past max_len: open-r1 (no clamp) rises again along the cosine; TRL clamps p to 1.
    (True, 200, False, 1.0), (True, 200, True, 0.5),
    (False, 150, False, -0.75), (False, 150, True, -0.5),
])
def test_cosine(correct: bool, length: int, clamp: bool, expected: float) -> None:
    component = Cosine(CosineSettings(max_len=100, clamp=clamp))
    assert component.score(judged("x" * length, correct), []) == pytest.approx(expected)


def test_cosine_token_unit_and_unknown_correctness() -> None:
    component = Cosine(CosineSettings(max_len=100, unit="tokens"))
    assert component.score(judged("short", True, tokens=100), []) == pytest.approx(0.5)
    assert component.score(judged("short", None), []) is None


def test_kimi_length() -> None:
    component = KimiLength(KimiLengthSettings())
    group = [judged("x" * 10, True), judged("x" * 20, False), judged("x" * 30, True),
             judged("x" * 10, False), judged("x" * 30, False)]
    assert [component.score(sample, group) for sample in group] == pytest.approx(
        [0.5, 0.0, -0.5, 0.0, -0.5])


def test_kimi_length_equal_lengths_give_zero() -> None:
    component = KimiLength(KimiLengthSettings(unit="tokens"))
    group = [judged("a", True, tokens=7), judged("bbbb", False, tokens=7)]
    assert [component.score(sample, group) for sample in group] == [0.0, 0.0]
    assert component.population == "group"
    assert KimiLength(KimiLengthSettings(scope="batch")).population == "batch"


# --- repetition -----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "size", "penalty", "expected"), [
    ("a b c a b c", 3, -1.0, -0.25),
    ("A b C a B c", 3, -1.0, -0.25),   # lower-cased words
    ("a b c a b c", 3, -0.5, -0.125),
    ("a b c d", 3, -1.0, 0.0),
    ("", 3, -1.0, 0.0),                # empty text
    ("a b", 3, -1.0, 0.0),             # fewer words than n
    ("a a a a", 1, -1.0, -0.75),
])
def test_repetition_words(text: str, size: int, penalty: float, expected: float) -> None:
    component = Repetition(RepetitionSettings(ngram_size=size, max_penalty=penalty))
    assert component.score(make_sample(text), []) == pytest.approx(expected)


def test_repetition_tokens() -> None:
    component = Repetition(RepetitionSettings(ngram_size=2, unit="tokens"))
    sample = make_sample("irrelevant text", ids=[1, 2, 1, 2, 1, 2])
    assert component.score(sample, []) == pytest.approx(-0.6)
    assert component.score(make_sample("a b c", ids=[5]), []) == 0.0


def test_repetition_positive_penalty_is_a_config_error() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_penalty"):
        RepetitionSettings(max_penalty=0.5)


# --- reasoning steps ------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("Step 1: a. Step 2: b.", 2 / 3),
    ("First, x. Second, y. Next, z. Finally, w.", 1.0),
    ("1. a\n2. b", 1 / 3),   # no MULTILINE: only the leading "1." matches ^\d+\.
    ("\n- a\n- b", 2 / 3),
    ("nothing", 0.0),
])
def test_reasoning_steps(text: str, expected: float) -> None:
    component = ReasoningSteps(ReasoningStepsSettings())
    assert component.score(make_sample(text), []) == pytest.approx(expected)


def test_char_fraction_counts_matching_characters() -> None:
    from rollq.consumers.scorer.components import CharFraction
    from rollq.consumers.scorer.components.char_fraction import CharFractionSettings

    component = CharFraction(CharFractionSettings())
    assert component.score(make_sample("a1b2"), []) == 0.5
    assert component.score(make_sample(""), []) == 0.0
    letters = CharFraction(CharFractionSettings(pattern="[a-z]"))
    assert letters.score(make_sample("ab12"), []) == 0.5
