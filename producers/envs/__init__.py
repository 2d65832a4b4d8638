"""Envs: what the rollout worker runs to turn a dataset item into a group of completions.

- ``base``: the ``Env`` protocol, ``Item`` and ``Rollout``.
- ``dataset``: single-turn GSM8K/MATH-style envs from JSONL, parquet or HF ``datasets``.
- ``multiturn``: the ``MultiTurnEnv`` protocol and the token-in/token-out bridge;
  ``observations``: how env observations become tokens; ``guess``: a real multi-turn env;
  ``adapters``: gem and SkyRL-gym envs as ``MultiTurnEnv``.
- ``registry``: ``make_env(name, **options)`` for the CLI; ``kinds``: other ecosystems'
  envs by name (``gem:ID``, ``skyrl:ID``, ``areal:MODULE:ATTRIBUTE``).
"""

from rollq.producers.envs.adapters import GemAdapter, SkyRLGymAdapter
from rollq.producers.envs.base import Env, Item, PolicyVersion, Rollout
from rollq.producers.envs.dataset import (
    GSM8K,
    MATH,
    DatasetEnv,
    PromptStyle,
    RecordFormat,
    gsm8k_env,
    last_boxed,
    load_records,
    math_env,
    parse_gsm8k_answer,
)
from rollq.producers.envs.guess import GuessGame
from rollq.producers.envs.multiturn import (
    EpisodeEnv,
    EpisodeRunner,
    MultiTurnEnv,
    RecordEpisodeEnv,
    StepResult,
    SyncEnvAdapter,
    SyncMultiTurnEnv,
    TruncatedTurn,
)
from rollq.producers.envs.observations import (
    ChatTemplateDelta,
    Observation,
    ObservationEncoder,
    TextTemplate,
)
from rollq.producers.envs.registry import make_env

__all__ = [
    "GSM8K",
    "MATH",
    "ChatTemplateDelta",
    "DatasetEnv",
    "Env",
    "EpisodeEnv",
    "EpisodeRunner",
    "GemAdapter",
    "GuessGame",
    "Item",
    "MultiTurnEnv",
    "Observation",
    "ObservationEncoder",
    "PolicyVersion",
    "PromptStyle",
    "RecordEpisodeEnv",
    "RecordFormat",
    "Rollout",
    "SkyRLGymAdapter",
    "StepResult",
    "SyncEnvAdapter",
    "SyncMultiTurnEnv",
    "TextTemplate",
    "TruncatedTurn",
    "gsm8k_env",
    "last_boxed",
    "load_records",
    "make_env",
    "math_env",
    "parse_gsm8k_answer",
]
