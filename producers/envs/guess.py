"""A number-guessing game: the smallest real multi-turn env.

The env thinks of a number in ``[low, high]`` (drawn from the seed, so a seed always gives
the same game) and answers each guess with "higher" or "lower". Reward: 1.0 on the turn the
model guesses right (terminated), 0.0 otherwise; after ``max_guesses`` wrong or unreadable
replies the episode is truncated. The model's guess is the last integer in its reply.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollq.producers.envs.multiturn import StepResult

_INTEGER = re.compile(r"-?\d+")


class GuessGame:
    """``MultiTurnEnv`` of the guessing game (async methods, no I/O)."""

    def __init__(self, low: int = 1, high: int = 16, max_guesses: int = 6) -> None:
        if low >= high:
            raise ValueError("low must be below high")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret: int | None = None
        self.guesses = 0

    async def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        return (f"I'm thinking of a number between {self.low} and {self.high}. "
                f"Guess it: reply with just a number. You have {self.max_guesses} guesses.")

    async def step(self, action: str) -> StepResult:
        if self.secret is None:
            raise RuntimeError("step() before reset()")
        self.guesses += 1
        found = _INTEGER.findall(action)
        info: dict[str, Any] = {"guesses": self.guesses}
        out_of_guesses = self.guesses >= self.max_guesses
        if not found:
            return (f"Please reply with a number between {self.low} and {self.high}.", 0.0,
                    False, out_of_guesses, {**info, "valid": False})
        guess = int(found[-1])
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {**info, "valid": True, "solved": True}
        hint = "higher" if guess < self.secret else "lower"
        return (f"{guess} is wrong: my number is {hint}.", 0.0, False, out_of_guesses,
                {**info, "valid": True, "solved": False})
