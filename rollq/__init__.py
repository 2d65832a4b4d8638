"""rollq: a durable rollout bus on Redis streams for GRPO-style training of language models.

The public surface, for trainers, envs and reward components::

    from rollq import SyncTrainerClient, TrainerClientSettings   # the trainer SDK
    from rollq import Env, Item, Rollout, MultiTurnEnv           # your own env
    from rollq import RewardComponent, ComponentSettings, Sample  # your own reward

The repository's folders are installed under this package: ``rollq.schemas`` (the
contract), ``rollq.producers`` (feeder, workers, envs, inference), ``rollq.consumers``
(bus, scorer, trainer SDK) and ``rollq.ops`` (the ``rollq`` command and its roles). Names
here load on first use, so ``import rollq`` costs nothing and the trainer SDK needs none
of the roles' extras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SURFACE: dict[str, tuple[str, ...]] = {
    "rollq.consumers.trainer": (
        "TrainerClient", "SyncTrainerClient", "TrainerClientSettings", "Batch", "SyncBatch",
        "BatchData", "BatchSize", "PauseMode", "PolicyPublisher", "WeightSyncError",
        "ResumeError", "DataParallelSteps", "init_ranks", "pack_groups", "pad_groups",
        "PackedBatch", "PaddedArrays", "TRAINER_GROUP"),
    "rollq.producers.envs": (
        "Env", "Item", "Rollout", "PolicyVersion", "DatasetEnv", "MultiTurnEnv", "EpisodeEnv",
        "SyncMultiTurnEnv", "StepResult", "Observation"),
    "rollq.consumers.scorer": (
        "RewardComponent", "ComponentSettings", "Sample", "Score", "RewardConfig",
        "RewardBridge"),
    "rollq.schemas": (
        "Completion", "TrajectoryGroup", "ScoredGroup", "RollqError", "ConfigError",
        "ContractError", "TransientError", "InferenceUnavailable", "BrokerUnavailable"),
}
_WHERE = {name: module for module, names in _SURFACE.items() for name in names}

__all__ = [  # the names of _SURFACE (tests/test_architecture.py checks they agree)
    "TRAINER_GROUP",
    "Batch",
    "BatchData",
    "BatchSize",
    "BrokerUnavailable",
    "Completion",
    "ComponentSettings",
    "ConfigError",
    "ContractError",
    "DataParallelSteps",
    "DatasetEnv",
    "Env",
    "EpisodeEnv",
    "InferenceUnavailable",
    "Item",
    "MultiTurnEnv",
    "Observation",
    "PackedBatch",
    "PaddedArrays",
    "PauseMode",
    "PolicyPublisher",
    "PolicyVersion",
    "ResumeError",
    "RewardBridge",
    "RewardComponent",
    "RewardConfig",
    "Rollout",
    "RollqError",
    "Sample",
    "Score",
    "ScoredGroup",
    "StepResult",
    "SyncBatch",
    "SyncMultiTurnEnv",
    "SyncTrainerClient",
    "TrainerClient",
    "TrainerClientSettings",
    "TrajectoryGroup",
    "TransientError",
    "WeightSyncError",
    "init_ranks",
    "pack_groups",
    "pad_groups",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rollq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from rollq.consumers.scorer import (
        ComponentSettings,
        RewardBridge,
        RewardComponent,
        RewardConfig,
        Sample,
        Score,
    )
    from rollq.consumers.trainer import (
        TRAINER_GROUP,
        Batch,
        BatchData,
        BatchSize,
        DataParallelSteps,
        PackedBatch,
        PaddedArrays,
        PauseMode,
        PolicyPublisher,
        ResumeError,
        SyncBatch,
        SyncTrainerClient,
        TrainerClient,
        TrainerClientSettings,
        WeightSyncError,
        init_ranks,
        pack_groups,
        pad_groups,
    )
    from rollq.producers.envs import (
        DatasetEnv,
        Env,
        EpisodeEnv,
        Item,
        MultiTurnEnv,
        Observation,
        PolicyVersion,
        Rollout,
        StepResult,
        SyncMultiTurnEnv,
    )
    from rollq.schemas import (
        BrokerUnavailable,
        Completion,
        ConfigError,
        ContractError,
        InferenceUnavailable,
        RollqError,
        ScoredGroup,
        TrajectoryGroup,
        TransientError,
    )
