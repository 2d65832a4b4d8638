"""Guess a number from 1 to 10 in three tries: reward 1.0 for the right number, -0.25 per
wrong guess (with a hint), 0.0 when the tries run out.

The test hooks a real env has too: its sessions (construction and ``close``) are appended
to the file ``GUESS_ENV_LOG`` names, so a test can see which sessions overlapped; a guess
of ``no reward`` ends the episode without a reward (a scorer that failed), ``crash`` kills
the server process mid-episode (the WebSocket closes), ``slow`` takes two seconds.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment

from tests.openenv_envs.guess_env.models import GuessAction, GuessObservation, GuessState

RULES = "Guess my number from 1 to 10. You have 3 tries. Answer with the number only."


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: one instance per session

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=str(uuid.uuid4()))
        self._closed = False
        self._log("open")

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        secret = random.Random(seed).randint(1, 10)
        self._state = GuessState(episode_id=episode_id or str(uuid.uuid4()), step_count=0,
                                 secret=secret, guesses_left=3)
        return GuessObservation(prompt=RULES, reward=None, done=False)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        text = action.guess.strip().lower()
        if text == "crash":
            os._exit(3)
        if text == "slow":
            time.sleep(2)
        self._state.step_count += 1
        if text == "no reward":
            return GuessObservation(prompt="", reward=None, done=True)
        self._state.guesses_left -= 1
        if text == str(self._state.secret):
            return GuessObservation(prompt="Right!", reward=1.0, done=True)
        if self._state.guesses_left == 0:
            return GuessObservation(prompt="No tries left.", reward=0.0, done=True)
        try:
            hint = "higher" if int(text) < self._state.secret else "lower"
        except ValueError:
            hint = "a number"
        return GuessObservation(prompt=f"Wrong: my number is {hint}.", reward=-0.25,
                                done=False)

    @property
    def state(self) -> GuessState:
        return self._state

    def close(self) -> None:
        if not self._closed:  # OpenEnv may close a session twice (its reaper, then the socket)
            self._closed = True
            self._log("close")

    def _log(self, event: str) -> None:
        path = os.environ.get("GUESS_ENV_LOG")
        if path:
            with open(path, "a") as log:
                log.write(f"{event} {id(self)} {time.monotonic():.6f}\n")
