"""A multi-turn env's episode return as a reward component: what the env itself paid out
over the episode, so a gem, SkyRL-gym or ``guess`` episode is scored on its own game with no
reward code.

The multi-turn bridge (``producers.envs.multiturn``) keeps every turn's reward in
``Completion.turn_rewards`` and their undiscounted sum in ``Completion.info["env_return"]``;
this component reads the latter (the scorer sees a completion's ``info`` as its
per-completion metadata). A turn cut short under ``truncated_turn: end_with_penalty`` has
added its penalty to that sum.
"""

from __future__ import annotations

from rollq.consumers.scorer.components.env_score import EnvScore, EnvScoreSettings


class EnvReturnSettings(EnvScoreSettings):
    """Settings of `env_return`: `field`, the per-completion (then per-group) metadata field
    holding the return (default `env_return`)."""

    field: str = "env_return"


class EnvReturn(EnvScore):
    """The episode's return (sum of the env's turn rewards, in the env's own units), read
    as `env_score` reads a posted score; None (skipped) when the completion has none (not a
    multi-turn episode, or a trajectory stored before returns were recorded) or it is not a
    finite number."""

    settings_model = EnvReturnSettings
