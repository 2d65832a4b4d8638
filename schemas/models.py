"""The wire models: what producers emit, what scorers emit, and dead letters.

The message unit is a whole group: one prompt and the N completions sampled for it. Groups
are never split in transit, so group statistics (GRPO advantages) are always computable.

Token ids come from the inference server and are never re-tokenised. In a multi-turn
episode the completion holds every token after the prompt — model turns and the env's
observations in order — and ``loss_mask`` marks which of them the model generated.

Values are part of the contract, not only shapes (``check_tokens``, ``check_json``): token
ids are >= 0 (and below the vocabulary size where a reader knows it), logprobs finite and
<= 0, loss masks 0 or 1, policy versions in [0, 2^31), every completion has a token, every
float (rewards, advantages, per-token values, times, metadata numbers) is finite, and
metadata holds nothing JSON cannot carry. The models check them when built; the codec
checks them again in both directions, since decoding assembles models without validation.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollq.schemas.arrays import (
    MAX_VERSION,
    Floats,
    Mask,
    RoutedExperts,
    TokenIds,
    check_values,
)

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

SCHEMA_VERSION: Literal[2] = 2
"""Version written into every entry's ``v`` field. Bump on any incompatible change.

2 added, per completion, ``sampling`` (``SamplingRecord``) and ``routed_experts``; both are
optional, so a version-1 entry decodes as one without them."""
READABLE_VERSIONS = (1, 2)
"""The versions ``decode`` reads; anything else is ``UnknownVersionError``."""


_JSON_INTS = (-(2**63), 2**64 - 1)  # what orjson reads and writes


def check_tokens(*, completion_ids: Any, logprobs: Any, loss_mask: Any,
                 token_versions: Any = None, vocab_size: int | None = None,
                 label: str = "{}") -> None:
    """Raise ValueError naming the field unless per-token arrays hold valid values.

    Works on one completion's arrays or on a whole group's, concatenated (the codec's
    case: one vectorised pass per field per group). ``vocab_size``, when given, bounds
    the token ids. Logprobs are the sampler's log-probabilities, so never above 0 (env
    tokens carry 0.0). ``label`` formats a field name for the message.
    """
    check_values(label.format("completion_ids"), completion_ids, low=0,
                 high=None if vocab_size is None else vocab_size - 1)
    check_values(label.format("logprobs"), logprobs, high=0.0)
    check_values(label.format("loss_mask"), loss_mask, high=1)
    if token_versions is not None:
        check_values(label.format("token_versions"), token_versions, low=0, high=MAX_VERSION)


def check_routed_positions(prompt_length: int, lengths: list[int], routed: list[Any]) -> None:
    """Raise ValueError unless each completion's routed experts (where present) cover its
    ``prompt + completion - 1`` positions, and all share one layer count and top-k."""
    shapes = set()
    for index, (length, experts) in enumerate(zip(lengths, routed, strict=True)):
        if experts is None:
            continue
        positions = prompt_length + length - 1
        if experts.shape[0] != positions:
            raise ValueError(f"completions[{index}].routed_experts has {experts.shape[0]} "
                             f"positions, the sequence {positions} (prompt + completion - 1)")
        shapes.add(experts.shape[1:])
    if len(shapes) > 1:
        raise ValueError(f"routed experts of one group differ in [layers, top_k]: {shapes}")


def check_json(name: str, value: Any) -> None:
    """Raise ValueError naming ``name`` where a JSON-carried value holds what JSON cannot
    carry faithfully: a NaN or infinite number, or an integer beyond 64 bits."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)  # exact types first: this runs on every encode
        if kind is str or item is None or kind is bool:
            continue
        if kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
        elif kind is float or isinstance(item, float | np.floating):
            if not math.isfinite(item):
                raise ValueError(f"{name} holds a non-finite number ({item})")
        elif kind is int or isinstance(item, int | np.integer):
            if not _JSON_INTS[0] <= item <= _JSON_INTS[1]:
                raise ValueError(f"{name} holds an integer beyond 64 bits")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, np.ndarray) and item.dtype.kind == "f":
            check_values(name, item)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True,
                              allow_inf_nan=False)

    @classmethod
    def from_valid(cls, values: dict[str, Any]) -> Self:
        """Build the model from values that are already valid, without validating them again.

        For the codec, which has checked every value against this model's field types
        (arrays typed and sized by construction, JSON validated in one pydantic-core pass):
        what ``model_construct`` does, minus its per-field default handling (every field is
        given), ~1 µs instead of ~8 µs; a group has dozens of these. Anything else builds
        models the validating way.
        """
        instance = cls.__new__(cls)
        object.__setattr__(instance, "__dict__", values)
        object.__setattr__(instance, "__pydantic_fields_set__", set(values))
        object.__setattr__(instance, "__pydantic_extra__", None)
        object.__setattr__(instance, "__pydantic_private__", None)
        return instance


class SamplingRecord(_Frozen):
    """How the server sampled one completion, as the worker asked for it and as the server
    says it reports logprobs. None means not known: a field the request did not send (the
    server's default applied, which a model's ``generation_config.json`` may set), or a
    server that does not say its logprobs mode.

    A trainer reads it to know what ``Completion.logprobs`` are (off-policy correction:
    ``consumers.trainer.correction``)."""

    temperature: FiniteFloat | None = None
    """Softmax temperature sent (1.0: the policy itself)."""
    top_p: FiniteFloat | None = None
    """Nucleus mass sent (1.0: off)."""
    top_k: int | None = None
    """Top-k sent (-1 or 0: off, vLLM's convention)."""
    min_p: FiniteFloat | None = None
    """Min-p sent (0.0: off)."""
    logprobs_mode: str | None = None
    """The server's ``--logprobs-mode`` (vLLM): ``raw_logprobs`` (its default: the model's
    log-softmax, before temperature and top-k/top-p, so an unchanged policy reads ratio 1),
    ``processed_logprobs`` (after them: with top_p < 1 an unchanged policy reads the kept
    mass, not 1), ``raw_logits`` or ``processed_logits`` (logits, not logprobs)."""
    model: str | None = None
    """The model name the request was served under (``--served-model-name``, or a LoRA
    adapter's name, which names the policy version with ``weight_sync='lora'``)."""


class Completion(_Frozen):
    """One sampled sequence of a group.

    All per-token arrays have the same length: the number of completion tokens.
    """

    completion_ids: TokenIds
    """Token ids after the prompt, exactly as the server returned them (int32)."""
    logprobs: Floats
    """The sampler's log-probability of each completion token (float32, natural log).
    Tokens the model did not generate (env observations) carry 0.0."""
    loss_mask: Mask
    """1 for tokens the model generated (trainable), 0 for env/tool tokens (uint8)."""
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    """Policy version the generation started under (the trainer's optimizer step)."""
    token_versions: TokenIds | None = None
    """Per-token policy versions (int32, each in [0, 2^31)), present only when the version
    changed mid-generation; when absent every token was generated under ``policy_version``."""
    finish_reason: str = ""
    """The server's finish reason of the last model turn: ``stop``, ``length``, ``abort``…"""
    text: str = ""
    """Decoded completion text, for humans and text-based rewards."""
    reasoning: str | None = None
    """The server's separate reasoning field (``reasoning``/``reasoning_content``), if any."""
    messages: list[dict[str, Any]] | None = None
    """The conversation after the prompt (multi-turn envs), for humans."""
    turn_rewards: list[float] = Field(default_factory=list)
    """Rewards the env gave after each model turn (multi-turn envs)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Free-form env information about this sequence (JSON-serialisable)."""
    sampling: SamplingRecord | None = None
    """How the server sampled this sequence (its first model turn's request); None where
    the producer did not record it (and in entries of schema version 1)."""
    routed_experts: RoutedExperts | None = None
    """Routing replay for MoE policies: the experts the server routed each position of
    ``prompt_ids + completion_ids`` to, ``[positions, layers, top_k]`` with ``positions =
    len(prompt_ids) + len(completion_ids) - 1`` (the last token was sampled, never
    forwarded), uint8/uint16/int32. Off by default (workers' ``routed_experts`` setting);
    row ``t`` is the routing of the forward pass that predicted token ``t + 1``."""

    @model_validator(mode="after")
    def _check_arrays(self) -> Completion:
        n = len(self.completion_ids)
        if n == 0:
            raise ValueError("completion_ids is empty: a completion has at least one token")
        for name in ("logprobs", "loss_mask", "token_versions"):
            array = getattr(self, name)
            if array is not None and len(array) != n:
                raise ValueError(f"{name} has {len(array)} values for {n} completion tokens")
        check_tokens(completion_ids=self.completion_ids, logprobs=self.logprobs,
                     loss_mask=self.loss_mask, token_versions=self.token_versions)
        check_json("messages", self.messages)
        check_json("info", self.info)
        return self

    @property
    def versions(self) -> TokenIds:
        """Per-token policy versions, filled from ``policy_version`` when not stored."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self.completion_ids), self.policy_version, dtype=np.int32)


class TrajectoryGroup(_Frozen):
    """A prompt and its N completions, as an env worker publishes it on ``traj``."""

    v: Literal[1, 2] = SCHEMA_VERSION
    kind: Literal["traj"] = "traj"
    group_id: str = Field(min_length=1)
    """Globally unique and stable: a re-run of the same job publishes the same id."""
    run: str = Field(min_length=1)
    env: str = Field(min_length=1)
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    """Policy version the group's generation started under, in [0, 2^31)."""
    prompt_ids: TokenIds
    """Prompt token ids (int32, >= 0), shared by every completion of the group."""
    prompt_text: str = ""
    prompt_messages: list[dict[str, Any]] | None = None
    completions: tuple[Completion, ...] = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    """What scoring needs from the env: gold answer, step labels, tests… (JSON-serialisable)."""
    created_at: float = 0.0
    """Unix time (seconds) the job started."""
    finished_at: float = 0.0
    """Unix time (seconds) the last completion arrived."""

    @model_validator(mode="after")
    def _check_values(self) -> TrajectoryGroup:
        check_values("prompt_ids", self.prompt_ids, low=0)
        check_routed_positions(len(self.prompt_ids),
                               [len(c.completion_ids) for c in self.completions],
                               [c.routed_experts for c in self.completions])
        check_json("prompt_messages", self.prompt_messages)
        check_json("metadata", self.metadata)
        return self

    @property
    def num_tokens(self) -> int:
        """Completion tokens over the whole group."""
        return sum(len(c.completion_ids) for c in self.completions)


class SequenceScore(_Frozen):
    """The scorer's verdict on one completion."""

    reward: float = Field(allow_inf_nan=False)
    """Total reward: the weighted sum of the reward components."""
    advantage: float = Field(allow_inf_nan=False)
    """The sequence advantage under the configured estimator (GRPO, Dr.GRPO, RLOO)."""
    token_advantages: Floats
    """Per-token advantages (float32), one per completion token; the sequence advantage
    broadcast (a read-only stride-0 view, ``schemas.broadcast``), or token-level values when
    process rewards are configured."""
    components: dict[str, FiniteFloat | None] = Field(default_factory=dict)
    """Each component's raw (unweighted) value; None where the component skipped."""
    token_rewards: Floats | None = None
    """Per-token rewards (float32) from process rewards, when configured."""

    @model_validator(mode="after")
    def _check_values(self) -> SequenceScore:
        check_values("token_advantages", self.token_advantages)
        if self.token_rewards is not None:
            check_values("token_rewards", self.token_rewards)
        return self


class ScoredGroup(_Frozen):
    """A trajectory group with its rewards and advantages, as scorers publish it on ``scored``."""

    v: Literal[1, 2] = SCHEMA_VERSION
    kind: Literal["scored"] = "scored"
    trajectory: TrajectoryGroup
    scores: tuple[SequenceScore, ...]
    weights: dict[str, float] = Field(default_factory=dict)
    """The weight of each component in the total reward."""
    flags: list[str] = Field(default_factory=list)
    """Reasons something unusual happened while scoring (a component timed out…)."""
    reward_config: str = ""
    """Name or hash of the reward configuration that produced the scores."""
    scored_at: float = 0.0

    @model_validator(mode="after")
    def _check_scores(self) -> ScoredGroup:
        completions = self.trajectory.completions
        if len(self.scores) != len(completions):
            raise ValueError(f"{len(self.scores)} scores for {len(completions)} completions")
        for i, (score, completion) in enumerate(zip(self.scores, completions, strict=True)):
            n = len(completion.completion_ids)
            if len(score.token_advantages) != n:
                raise ValueError(f"scores[{i}].token_advantages has {len(score.token_advantages)}"
                                 f" values for {n} tokens")
            if score.token_rewards is not None and len(score.token_rewards) != n:
                raise ValueError(f"scores[{i}].token_rewards has {len(score.token_rewards)}"
                                 f" values for {n} tokens")
        return self

    @property
    def group_id(self) -> str:
        return self.trajectory.group_id

    @property
    def policy_version(self) -> int:
        return self.trajectory.policy_version


class DeadLetter(_Frozen):
    """An entry that could not be processed, with why and its original fields, byte for byte."""

    v: Literal[1, 2] = SCHEMA_VERSION
    kind: Literal["dead"] = "dead"
    reason: str
    """Machine-friendly reason slug, e.g. ``decode_error``, ``max_deliveries``."""
    detail: str = ""
    """Human-readable detail (the exception message)."""
    source_stream: str
    source_id: str
    consumer_group: str
    deliveries: int = 0
    dead_at: float = 0.0
    payload: dict[bytes, bytes] = Field(default_factory=dict)
    """The original entry's fields, unchanged, so it can be requeued or inspected."""


StreamGroup = TrajectoryGroup | ScoredGroup
