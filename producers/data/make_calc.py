"""Generate ``calc.jsonl``: the ``tools`` task's questions, ``a op b`` with a, b in 0..9, op one
of ``+ - *``, whose result is a single digit (0..9); 30 held out.

Each line::

    {"problem": "What is 7 - 3?", "expression": "7 - 3", "answer": 4, "split": "train"}

152 questions (55 sums, 55 differences, 42 products). Every answer is one digit, so an answer
drawn uniformly from 0..9 is right with probability 1/10 and copying the tool's result is one
token. ``split`` is ``train`` (122) or ``heldout`` (30, drawn with ``random.Random(seed)``).
Regenerate with ``python -m rollq.producers.data.make_calc`` (same seed, same bytes).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HELDOUT = 30
"""Questions held out of training (of 152)."""

_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_calc(seed: int = 0, heldout: int = HELDOUT) -> list[dict[str, object]]:
    """Every single-digit ``a op b`` with a single-digit result, in (op, a, b) order."""
    questions = [(a, op, b) for op in _OPERATIONS for a in range(10) for b in range(10)
                 if 0 <= _OPERATIONS[op](a, b) <= 9]
    held = set(random.Random(seed).sample(questions, heldout))
    return [{"problem": f"What is {a} {op} {b}?", "expression": f"{a} {op} {b}",
             "answer": _OPERATIONS[op](a, b),
             "split": "heldout" if (a, op, b) in held else "train"} for a, op, b in questions]


def write_calc(path: Path, seed: int = 0) -> None:
    """Write the records as JSONL to ``path``."""
    lines = (json.dumps(record, ensure_ascii=False) for record in make_calc(seed))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_calc(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("calc.jsonl"))
