"""Reward components, by concept, and the registry that names them in configs."""

from __future__ import annotations

import importlib
from typing import Any

from rollq.consumers.scorer.components.accuracy import Accuracy, AccuracySettings
from rollq.consumers.scorer.components.base import (
    ComponentSettings,
    Placement,
    Population,
    RewardComponent,
    Score,
)
from rollq.consumers.scorer.components.char_fraction import CharFraction
from rollq.consumers.scorer.components.code import CodeExecution
from rollq.consumers.scorer.components.env_return import EnvReturn
from rollq.consumers.scorer.components.env_score import EnvScore
from rollq.consumers.scorer.components.format import (
    Format,
    FormatMarkers,
    FormatMarkersSettings,
    FormatSettings,
    Marker,
    TagCount,
    TagCountSettings,
)
from rollq.consumers.scorer.components.length import (
    Cosine,
    CosineSettings,
    KimiLength,
    KimiLengthSettings,
    LengthBounty,
    LengthBountySettings,
    SoftOverlong,
    SoftOverlongSettings,
)
from rollq.consumers.scorer.components.process import PrmSettings, ProcessReward, ProcessSettings
from rollq.consumers.scorer.components.reasoning_gym import ReasoningGym, ReasoningGymSettings
from rollq.consumers.scorer.components.reasoning_steps import ReasoningSteps, ReasoningStepsSettings
from rollq.consumers.scorer.components.repetition import Repetition, RepetitionSettings

COMPONENTS: dict[str, type[RewardComponent[Any]]] = {
    "accuracy": Accuracy,
    "format": Format,
    "format_markers": FormatMarkers,
    "tag_count": TagCount,
    "length_bounty": LengthBounty,
    "soft_overlong": SoftOverlong,
    "cosine": Cosine,
    "length": KimiLength,
    "repetition": Repetition,
    "reasoning_steps": ReasoningSteps,
    "process": ProcessReward,
    "char_fraction": CharFraction,
    "code": CodeExecution,
    "env_score": EnvScore,
    "env_return": EnvReturn,
    "reasoning_gym": ReasoningGym,
}
"""Built-in component type names, as written in a config's `component` field."""


def resolve_component(name: str) -> type[RewardComponent[Any]]:
    """The component class for a built-in `name` or a dotted `package.module:Class`.

    Raises ValueError naming what could not be found.
    """
    if name in COMPONENTS:
        return COMPONENTS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown component {name!r}; built-ins: {', '.join(sorted(COMPONENTS))}, "
            "or a dotted path 'package.module:Class'")
    module_name, _, class_name = name.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import component {name!r}: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, RewardComponent)):
        raise ValueError(f"{name!r} is not a RewardComponent subclass")
    return found


__all__ = [
    "COMPONENTS",
    "Accuracy",
    "AccuracySettings",
    "CharFraction",
    "ComponentSettings",
    "Cosine",
    "CosineSettings",
    "EnvReturn",
    "Format",
    "FormatMarkers",
    "FormatMarkersSettings",
    "FormatSettings",
    "KimiLength",
    "KimiLengthSettings",
    "LengthBounty",
    "LengthBountySettings",
    "Marker",
    "Placement",
    "Population",
    "PrmSettings",
    "ProcessReward",
    "ProcessSettings",
    "ReasoningGym",
    "ReasoningGymSettings",
    "ReasoningSteps",
    "ReasoningStepsSettings",
    "Repetition",
    "RepetitionSettings",
    "RewardComponent",
    "Score",
    "SoftOverlong",
    "SoftOverlongSettings",
    "TagCount",
    "TagCountSettings",
    "resolve_component",
]
