"""The reward configuration: named components, presets, advantages, traces and the pool.

Example (YAML)::

    preset: r1                     # optional: r1 | roll_universal
    components:                    # merged by name into the preset's (settings too)
      - name: accuracy
        settings: {gold_field: solution, on_unparseable_gold: zero}
      - name: overlong
        component: soft_overlong   # a built-in name, or "package.module:Class"
        weight: 0.5
        settings: {max_completion_len: 4096, cache: 512}
        on_error: skip_component   # dead_letter (default) | skip_component
        retries: 1                 # in-process retries of a failed call (default 1)
        timeout_s: 5
    advantages: {method: grpo, eps: 1.0e-6, ddof: 0, zero_variance: drop}
    trace: {open_tag: "<think>", close_tag: "</think>"}
    pool: {workers: 2, start_method: spawn}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rollq.consumers.scorer.advantages import AdvantageMethod
from rollq.consumers.scorer.components import COMPONENTS, RewardComponent, resolve_component
from rollq.consumers.scorer.errors import RewardConfigError
from rollq.consumers.scorer.pool import StartMethod

_FROZEN = ConfigDict(frozen=True, extra="forbid")

PRESETS: dict[str, dict[str, Any]] = {
    # open-r1's default reward_funcs ["accuracy", "format", "tag_count"].
    "r1": {
        "combine": "weighted_sum",
        "components": [
            {"name": "accuracy", "component": "accuracy"},
            {"name": "format", "component": "format", "settings": {"preset": "r1"}},
            {"name": "tag_count", "component": "tag_count"},
        ],
    },
    # ROLL #426: correctness wins outright when positive, else -1 + markers + bounty.
    "roll_universal": {
        "combine": "roll_universal",
        "components": [
            {"name": "accuracy", "component": "accuracy"},
            {"name": "format_markers", "component": "format_markers"},
            {"name": "length_bounty", "component": "length_bounty"},
        ],
    },
}


class ComponentEntry(BaseModel):
    """One named component of the reward.

    - `name`: the key of its raw values in scored entries (unique in the config).
    - `component`: a built-in type name (see `COMPONENTS`) or `package.module:Class`.
    - `weight`: its factor in the total (dimensionless).
    - `settings`: the component's own settings (validated against its settings model).
    - `on_error`: what a call that still fails after `retries` means (it raised, timed
      out, or its pool process died: the reward is unknown, never 0):
      `dead_letter` (the default: the group fails with a `ScoringError`; the scorer
      retries it, then dead-letters it as `reward_error` naming this component) or
      `skip_component` (this component's value is None for that sample: it adds nothing
      to the total, is flagged in the scored entry and counted under
      `flag:<name>:<reason>`, and components reading correctness see `correct=None`).
      The old `zero` policy is rejected: a failure is not a wrong answer.
    - `retries`: in-process retries of a failed call before `on_error` applies (0–5;
      default 1), after a short back-off (0.05 s, doubled per retry).
    - `timeout_s`: seconds per sample, enforced for pool and async components (inline
      components are cheap by contract and are timed, not interrupted). A pool call of
      several samples gets `timeout_s` for each; when it runs out, each sample is called
      again alone with its own `timeout_s`. A timeout is a failure like an exception; a
      component that wants "too slow" to score 0 (e.g. a candidate's code running too
      long) must enforce that itself and return 0.
    - `run_in`: force `inline` or `process` placement (default: the component decides).
    """

    model_config = _FROZEN

    name: str = Field(min_length=1)
    component: str = Field(min_length=1)
    weight: float = 1.0
    settings: dict[str, Any] = Field(default_factory=dict)
    on_error: Literal["dead_letter", "skip_component"] = "dead_letter"
    retries: int = Field(default=1, ge=0, le=5)
    timeout_s: float = Field(default=10.0, gt=0)
    run_in: Literal["inline", "process"] | None = None

    @field_validator("on_error", mode="before")
    @classmethod
    def _no_zero_policy(cls, value: Any) -> Any:
        if value == "zero":
            raise ValueError(
                "'zero' is no longer accepted: a component that fails is not a score of 0; "
                "use 'dead_letter' (retry, then dead-letter the group: the default) or "
                "'skip_component' (the value is None for that sample, flagged and counted)")
        return value

    @field_validator("component")
    @classmethod
    def _known(cls, value: str) -> str:
        resolve_component(value)
        return value

    @model_validator(mode="after")
    def _settings_valid(self) -> ComponentEntry:
        cls = resolve_component(self.component)
        try:
            cls.settings_model.model_validate(self.settings)
        except ValidationError as exc:
            raise ValueError(f"component {self.name!r}: " + _describe(exc, "settings")) from None
        return self

    def build(self) -> RewardComponent[Any]:
        """A fresh component instance (pure: no I/O, no event loop)."""
        cls = resolve_component(self.component)
        return cls(cls.settings_model.model_validate(self.settings))


class AdvantageSettings(BaseModel):
    """How a group's rewards become advantages.

    - `method`: `grpo` ((r - mean)/(std + eps)), `dr_grpo` (r - mean), `rloo`.
    - `eps`: added to the std (GRPO and process advantages); 1e-6 as verl (TRL 1e-4,
      AReaL 1e-5).
    - `ddof`: delta degrees of freedom of the std: 0 population (verl), 1 Bessel (TRL).
    - `zero_variance`: a group whose reward variance ≤ `variance_tolerance` is `drop`ped
      (with reason `zero_variance`) or kept with zero advantages (`keep`).
    - `process_component`: name of a `process` component whose step scores give
      token-level advantages (return-to-go of group-normalised step rewards); when None
      the sequence advantage is broadcast over each completion's tokens.
    """

    model_config = _FROZEN

    method: AdvantageMethod = "grpo"
    eps: float = Field(default=1e-6, ge=0)
    ddof: Literal[0, 1] = 0
    zero_variance: Literal["drop", "keep"] = "drop"
    variance_tolerance: float = Field(default=1e-12, ge=0)
    process_component: str | None = None


class TraceSettings(BaseModel):
    """The reasoning tags, used when the server did not split the reasoning out."""

    model_config = _FROZEN

    open_tag: str = Field(default="<think>", min_length=1)
    close_tag: str = Field(default="</think>", min_length=1)


class PoolSettings(BaseModel):
    """The process pool of CPU-heavy components: `workers` processes, started with
    `start_method` (`spawn` is safe everywhere; `fork` is fastest but unsafe with threads)."""

    model_config = _FROZEN

    workers: int = Field(default=2, ge=1)
    start_method: StartMethod = "spawn"


class RewardConfig(BaseModel):
    """The whole reward: components, how they combine, advantages, traces, pool.

    - `preset`: `r1` or `roll_universal`; its components are merged with `components`
      by name (an entry with a preset's name updates it, settings merged key by key).
    - `combine`: `weighted_sum` (Σ weight·value over non-None values) or `roll_universal`
      (weight·correctness if correctness > 0, else -1 + Σ weight·value of the others).
      Defaults to the preset's, else `weighted_sum`.
    - `correctness`: the component whose positive value means "correct" (for cosine,
      length and roll_universal); default: the first `accuracy` component.
    """

    model_config = _FROZEN

    preset: Literal["r1", "roll_universal"] | None = None
    components: tuple[ComponentEntry, ...] = ()
    combine: Literal["weighted_sum", "roll_universal"] = "weighted_sum"
    correctness: str | None = None
    advantages: AdvantageSettings = AdvantageSettings()
    trace: TraceSettings = TraceSettings()
    pool: PoolSettings = PoolSettings()

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or data.get("preset") not in PRESETS:
            return data
        preset = PRESETS[data["preset"]]
        merged: dict[str, dict[str, Any]] = {
            entry["name"]: dict(entry) for entry in preset["components"]}
        for entry in data.get("components") or ():
            if isinstance(entry, Mapping) and entry.get("name") in merged:
                base = merged[entry["name"]]
                settings = {**base.get("settings", {}), **entry.get("settings", {})}
                merged[entry["name"]] = {**base, **entry, "settings": settings}
            elif isinstance(entry, Mapping):
                merged[str(entry.get("name"))] = dict(entry)
            else:
                return data  # not a mapping: let field validation report it
        return {"combine": preset["combine"], **data, "components": list(merged.values())}

    @model_validator(mode="after")
    def _consistent(self) -> RewardConfig:
        names = [entry.name for entry in self.components]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"components: duplicate names {duplicates}")
        if not self.components:
            raise ValueError("components: at least one component (or a preset) is needed")
        needs = [e.name for e in self.components
                 if resolve_component(e.component).needs_correctness]
        if (needs or self.combine == "roll_universal") and self.correctness_name() is None:
            raise ValueError(
                f"correctness: {needs or ['combine: roll_universal']} need a correctness "
                "component; add an 'accuracy' component or set 'correctness'")
        if self.correctness is not None and self.correctness not in names:
            raise ValueError(f"correctness: no component named {self.correctness!r}")
        judge = next((e for e in self.components if e.name == self.correctness_name()), None)
        if (self.combine == "roll_universal" and judge is not None
                and judge.on_error == "skip_component"):
            raise ValueError(
                f"components.{judge.name}.on_error: 'skip_component' cannot apply to the "
                "correctness component under combine 'roll_universal', which would read an "
                "unknown correctness as wrong (-1); use 'dead_letter'")
        process = self.advantages.process_component
        if process is not None:
            entry = next((e for e in self.components if e.name == process), None)
            if entry is None or resolve_component(entry.component) is not COMPONENTS["process"]:
                raise ValueError(f"advantages.process_component: {process!r} is not the name "
                                 "of a 'process' component")
        return self

    def correctness_name(self) -> str | None:
        """The name of the correctness component, if any."""
        if self.correctness is not None:
            return self.correctness
        return next((e.name for e in self.components if e.component == "accuracy"), None)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RewardConfig:
        """Validate `data`; raises RewardConfigError naming every offending field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RewardConfigError("invalid reward config: " + _describe(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> RewardConfig:
        """Load and validate a YAML file (see the module docstring for the format)."""
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise RewardConfigError(f"cannot read reward config {str(path)!r}: {exc}") from None
        if not isinstance(data, Mapping):
            raise RewardConfigError(f"reward config {str(path)!r} must be a mapping")
        return cls.from_mapping(data)


def _describe(error: ValidationError, prefix: str = "") -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(part) for part in (prefix, *item["loc"]) if part != "")
        message = str(item["msg"]).removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)
