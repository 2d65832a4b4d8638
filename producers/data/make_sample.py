"""Generate ``gsm8k_sample.jsonl``: deterministic GSM8K-format arithmetic word problems.

Each line is ``{"question": ..., "answer": ...}``; the answer is a worked solution with
GSM8K's ``<<a+b=c>>`` calculator annotations, ending in ``#### N``. Regenerate with
``python -m producers.data.make_sample`` (same seed, same bytes).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NAMES = ["Alice", "Bob", "Carla", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]

Problem = tuple[str, str]


def _add(rng: random.Random, who: str, what: str) -> Problem:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    return (f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have now?",
            f"{who} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {what} now.\n#### {a + b}")


def _subtract(rng: random.Random, who: str, what: str) -> Problem:
    a = rng.randint(20, 90)
    b = rng.randint(1, a - 1)
    return (f"{who} had {a} {what} and gave {b} of them to a friend. How many {what} are left?",
            f"{who} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {what} left.\n#### {a - b}")


def _multiply(rng: random.Random, who: str, what: str) -> Problem:
    boxes, each = rng.randint(2, 12), rng.randint(2, 15)
    total = boxes * each
    return (f"{who} buys {boxes} boxes with {each} {what} in each box. How many {what} does "
            f"{who} buy in total?",
            f"{who} buys {boxes} * {each} = <<{boxes}*{each}={total}>>{total} {what}.\n"
            f"#### {total}")


def _divide(rng: random.Random, who: str, what: str) -> Problem:
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    return (f"{who} shares {total} {what} equally among {friends} friends. How many {what} "
            f"does each friend get?",
            f"Each friend gets {total} / {friends} = <<{total}/{friends}={each}>>{each} "
            f"{what}.\n#### {each}")


def _two_step(rng: random.Random, who: str, what: str) -> Problem:
    packs, each, lost = rng.randint(2, 8), rng.randint(3, 12), rng.randint(1, 5)
    bought = packs * each
    left = bought - lost
    return (f"{who} buys {packs} packs of {what} with {each} in each pack, then loses {lost}. "
            f"How many {what} does {who} have?",
            f"{who} buys {packs} * {each} = <<{packs}*{each}={bought}>>{bought} {what}.\n"
            f"After losing {lost}, {who} has {bought} - {lost} = <<{bought}-{lost}={left}>>"
            f"{left} {what}.\n#### {left}")


def _price(rng: random.Random, who: str, what: str) -> Problem:
    count, price = rng.randint(2, 20), rng.randint(1, 9)
    cost = count * price
    paid = cost + rng.randint(0, 20)
    change = paid - cost
    return (f"{who} buys {count} {what} at ${price} each and pays with ${paid}. How much change "
            f"does {who} get, in dollars?",
            f"The {what} cost {count} * {price} = <<{count}*{price}={cost}>>{cost} dollars.\n"
            f"The change is {paid} - {cost} = <<{paid}-{cost}={change}>>{change} dollars.\n"
            f"#### {change}")


KINDS: list[Callable[[random.Random, str, str], Problem]] = [
    _add, _subtract, _multiply, _divide, _two_step, _price]


def make_problems(count: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """``count`` problems, the same for the same ``seed``."""
    rng = random.Random(seed)
    problems = []
    for index in range(count):
        kind = KINDS[index % len(KINDS)]
        question, answer = kind(rng, rng.choice(NAMES), rng.choice(THINGS))
        problems.append({"question": question, "answer": answer})
    return problems


def write_sample(path: Path, count: int = 200, seed: int = 0) -> None:
    """Write the problems as JSONL to ``path``."""
    lines = (json.dumps(problem, ensure_ascii=False) for problem in make_problems(count, seed))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name(
        "gsm8k_sample.jsonl")
    write_sample(target)
