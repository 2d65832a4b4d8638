"""Generate ``sums.jsonl``: the 100 single-digit sums ``a + b`` (a, b in 0..9), 20 held out.

Each line is a MATH-format record::

    {"problem": "What is 3 + 4?", "solution": "<think>3 + 4</think> \\\\boxed{7}",
     "a": 3, "b": 4, "split": "train"}

``split`` is ``train`` (80 pairs) or ``heldout`` (20 pairs, drawn with ``random.Random(seed)``;
never trained on, only evaluated). The solution is the target format: a closed think block
that restates the sum, then exactly one ``\\boxed{}`` with the answer. Regenerate with
``python -m producers.data.make_sums`` (same seed, same bytes).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HELDOUT = 20
"""Pairs held out of training (of 100)."""


def make_sums(seed: int = 0, heldout: int = HELDOUT) -> list[dict[str, object]]:
    """All 100 ordered pairs in (a, b) order, ``heldout`` of them marked ``heldout``."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    held = set(random.Random(seed).sample(pairs, heldout))
    return [{"problem": f"What is {a} + {b}?", "solution": f"<think>{a} + {b}</think> "
             f"\\boxed{{{a + b}}}", "a": a, "b": b,
             "split": "heldout" if (a, b) in held else "train"} for a, b in pairs]


def write_sums(path: Path, seed: int = 0) -> None:
    """Write the records as JSONL to ``path``."""
    lines = (json.dumps(record, ensure_ascii=False) for record in make_sums(seed))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_sums(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("sums.jsonl"))
