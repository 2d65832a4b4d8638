"""Synthetic rollouts shared by the benchmarks: math-like problems, completion texts, and
trajectory groups of any shape with GRPO scores.

It imports only numpy and ``schemas``, so a benchmark built on it (``bench.gpu_trainer``)
runs where the scorer's dependencies (math-verify, arq, fastapi) are not installed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from rollq.schemas import Completion, ScoredGroup, SequenceScore, TrajectoryGroup

RUN = "benchtrainer"
"""The run of ``bench.trainer``'s (and ``bench.gpu_trainer``'s) groups."""

# ----------------------------------------------------------------------------- text


_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Ken", "Alexis",
          "Tina", "Randy", "Joy", "Carla", "Mei", "Samir", "Olga")
_ITEMS = ("clips", "apples", "pages", "marbles", "cookies", "stickers", "books", "pencils",
          "eggs", "tickets", "shells", "cupcakes")
_FILLER = (
    "Let me re-read the problem to make sure I have the quantities right.",
    "I should be careful with the units here.",
    "Hmm, wait, let me double-check that step before moving on.",
    "That seems reasonable, so I will continue with the next part.",
    "Let me organise what we know so far.",
    "Actually, I think there is a simpler way to see this.",
    "So far everything is consistent with the statement of the problem.",
    "Okay, now the remaining part of the question.",
)


@dataclass(frozen=True)
class Problem:
    prompt: str
    gold: str
    """The gold answer as the env stores it in ``metadata["answer"]``."""
    answer: str
    """The correct answer as LaTeX (what goes into ``\\boxed{}``)."""
    wrong: str


def make_problem(rng: np.random.Generator) -> Problem:
    """A GSM8K-like word problem (integer answer) or a MATH-like one (fraction answer)."""
    name, item = _NAMES[int(rng.integers(len(_NAMES)))], _ITEMS[int(rng.integers(len(_ITEMS)))]
    if rng.random() < 0.6:
        a, b, c = (int(x) for x in rng.integers(3, 60, 3))
        total = a * b - c
        prompt = (f"{name} has {a} boxes with {b} {item} in each box. {name} gives away {c} "
                  f"{item}. How many {item} does {name} have left?")
        return Problem(prompt, str(total), str(total), str(total + int(rng.integers(1, 9))))
    p, q = (int(x) for x in rng.integers(2, 13, 2))
    q += p  # p/q < 1
    g = int(np.gcd(p, q))
    frac = f"\\frac{{{p // g}}}{{{q // g}}}"
    prompt = (f"A bag holds {q} {item}, {p} of them red. What fraction of the {item} are red? "
              "Express your answer as a common fraction.")
    wrong = f"\\frac{{{q // g}}}{{{p // g + q // g}}}"
    return Problem(prompt, f"${frac}$", frac, wrong)


def make_sentence(rng: np.random.Generator, step: int) -> str:
    a, b, c = (int(x) for x in rng.integers(2, 99, 3))
    kind = int(rng.integers(7))
    if kind == 0:
        return f"Step {step}: we multiply {a} by {b}, so ${a} \\times {b} = {a * b}$."
    if kind == 1:
        return (f"Then we subtract {c} from that: ${a * b} - {c} = {a * b - c}$, which is "
                f"what is left after this step.")
    if kind == 2:
        return (f"The fraction of the total is $\\frac{{{a}}}{{{a + b}}}$, and simplifying "
                f"by the common factor gives $\\frac{{{a // int(np.gcd(a, a + b))}}}"
                f"{{{(a + b) // int(np.gcd(a, a + b))}}}$.")
    if kind == 3:
        return (f"Adding the two amounts, ${a} + {b} = {a + b}$, and then {c} more makes "
                f"{a + b + c} in total.")
    if kind == 4:
        return (f"If each of the {a} groups has {b} items, the number of items is {a * b}; "
                f"dividing by {c} gives about {a * b / c:.2f}.")
    if kind == 5:
        return f"Let $x$ be the unknown amount. Then $x + {a} = {a + b}$, so $x = {b}$."
    return _FILLER[int(rng.integers(len(_FILLER)))]


def make_completion_text(rng: np.random.Generator, problem: Problem,
                         correct: bool) -> tuple[str, str]:
    """A completion in one of the shapes policies produce, and its finish reason.

    55% open-r1 format (``<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>``), 25% a
    think block then a prose answer, 10% no tags, 10% truncated inside the reasoning.
    """
    target = int(rng.integers(900, 2900))
    steps = ["Let me work through this step by step."]
    size = len(steps[0])
    while size < target:
        sentence = make_sentence(rng, len(steps))
        steps.append(sentence)
        size += len(sentence) + 1
    reasoning = " ".join(steps)
    answer = problem.answer if correct else problem.wrong
    shape = rng.random()
    if shape < 0.55:
        return (f"<think>\n{reasoning}\n</think>\n<answer>\nThe answer is "
                f"$\\boxed{{{answer}}}$.\n</answer>", "stop")
    if shape < 0.80:
        return (f"<think>\n{reasoning}\n</think>\n\nSo the final answer is "
                f"$\\boxed{{{answer}}}$.", "stop")
    if shape < 0.90:
        return f"{reasoning}\n\nTherefore the answer is $\\boxed{{{answer}}}$.", "stop"
    return f"<think>\n{reasoning}", "length"



# ----------------------------------------------------------------------------- groups


def _short_text(rng: np.random.Generator, answer: str) -> str:
    a, b = (int(x) for x in rng.integers(2, 99, 2))
    return (f"<think>\nWe need {a} times {b}: ${a} \\times {b} = {a * b}$, then compare "
            f"with the question.\n</think>\nThe answer is $\\boxed{{{answer}}}$.")


def make_group(rng: np.random.Generator, group_size: int, seq_len: int, prompt_len: int,
               short_text: bool, vocab: int = 150_000) -> TrajectoryGroup:
    """A trajectory group; ``short_text``: ~120 B per completion, else 1-3 KB; token ids
    below ``vocab``."""
    problem = make_problem(rng)
    completions = []
    for _ in range(group_size):
        correct = bool(rng.random() < 0.5)
        answer = problem.answer if correct else problem.wrong
        if short_text:
            text, finish = _short_text(rng, answer), "stop"
        else:
            text, finish = make_completion_text(rng, problem, correct)
        completions.append(Completion(
            completion_ids=rng.integers(0, vocab, seq_len, dtype=np.int32),
            logprobs=-rng.random(seq_len, dtype=np.float32) * 2,
            loss_mask=np.ones(seq_len, np.uint8),
            policy_version=0, finish_reason=finish, text=text,
        ))
    now = time.time()
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex, run=RUN, env="math", policy_version=0,
        prompt_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
        prompt_text=problem.prompt, completions=tuple(completions),
        metadata={"answer": problem.gold}, created_at=now, finished_at=now,
    )


def make_groups(count: int, group_size: int, seq_len: int, prompt_len: int,
                short_text: bool, distinct: int = 16,
                vocab: int = 150_000) -> list[TrajectoryGroup]:
    """``count`` groups with unique ids from ``distinct`` random bases."""
    rng = np.random.default_rng(0)
    bases = [make_group(rng, group_size, seq_len, prompt_len, short_text, vocab)
             for _ in range(min(distinct, count))]
    return [bases[i % len(bases)].model_copy(update={"group_id": uuid.uuid4().hex})
            for i in range(count)]


def grpo_scored(group: TrajectoryGroup, rng: np.random.Generator) -> ScoredGroup:
    """Scores as a GRPO scorer forwards them: random 0/1 rewards, normalised advantages
    broadcast over each completion's tokens."""
    rewards = rng.integers(0, 2, len(group.completions)).astype(np.float32)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    return ScoredGroup(
        trajectory=group,
        scores=tuple(
            SequenceScore(reward=float(r), advantage=float(a),
                          token_advantages=np.full(len(c.completion_ids), a, np.float32),
                          components={"accuracy": float(r)})
            for r, a, c in zip(rewards, advantages, group.completions, strict=True)
        ),
        weights={"accuracy": 1.0}, reward_config="bench", scored_at=time.time(),
    )
