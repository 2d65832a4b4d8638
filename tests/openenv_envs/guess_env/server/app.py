"""The guessing game's server: ``uvicorn tests.openenv_envs.guess_env.server.app:app``."""

from __future__ import annotations

from openenv.core.env_server.http_server import create_app

from tests.openenv_envs.guess_env.models import GuessAction, GuessObservation
from tests.openenv_envs.guess_env.server.guess_environment import GuessEnvironment

app = create_app(
    GuessEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess_env",
    max_concurrent_envs=1,  # the template's default: raise it to serve sessions at once
)
