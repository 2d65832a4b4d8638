"""Scoring: reasoning traces, reward components, the reward bridge and advantages.

Pure scoring logic; the stream consumer lives in `consumers.scorer.consumer`.
"""

from rollq.consumers.scorer.advantages import (
    AdvantageMethod,
    broadcast_advantages,
    compute_advantages,
    compute_process_advantages,
    is_zero_variance,
)
from rollq.consumers.scorer.bridge import ComponentFlag, GroupScore, RewardBridge
from rollq.consumers.scorer.components import (
    COMPONENTS,
    ComponentSettings,
    RewardComponent,
    Score,
    resolve_component,
)
from rollq.consumers.scorer.config import (
    PRESETS,
    AdvantageSettings,
    ComponentEntry,
    PoolSettings,
    RewardConfig,
    TraceSettings,
)
from rollq.consumers.scorer.errors import MissingFieldError, RewardConfigError, ScoringError
from rollq.consumers.scorer.pool import WorkerPool
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.scorer.traces import Trace, extract_reasoning

__all__ = [
    "COMPONENTS",
    "PRESETS",
    "AdvantageMethod",
    "AdvantageSettings",
    "ComponentEntry",
    "ComponentFlag",
    "ComponentSettings",
    "GroupScore",
    "MissingFieldError",
    "PoolSettings",
    "RewardBridge",
    "RewardComponent",
    "RewardConfig",
    "RewardConfigError",
    "Sample",
    "Score",
    "ScoringError",
    "Trace",
    "TraceSettings",
    "WorkerPool",
    "broadcast_advantages",
    "compute_advantages",
    "compute_process_advantages",
    "extract_reasoning",
    "is_zero_variance",
    "resolve_component",
]
