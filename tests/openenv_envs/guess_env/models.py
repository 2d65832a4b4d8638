"""The guessing game's action and observation (OpenEnv's pydantic base classes)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    """A guess, as the model wrote it."""

    guess: str


class GuessObservation(Observation):
    """What the player is told: the rules, then a hint after each wrong guess."""

    prompt: str = ""


class GuessState(State):
    """The secret and the guesses left."""

    secret: int = 0
    guesses_left: int = 0
