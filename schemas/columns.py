"""A decoded entry's values as the entry holds them: flat arrays, not per-completion objects.

``schemas.decoding`` checks every value of an entry and returns these; the models
(``TrajectoryGroup``, ``ScoredGroup``) are assembled from them only when asked for
(``group()``), without a second validation. A trainer lays its batch out straight from the
columns (``consumers.trainer.layout``) and builds the models of a batch only when its code
reads ``Batch.groups``: for a 16-completion group that spares the 32 per-completion models,
their dicts and the 64 array slices on the hot path (about half of decoding it).

The arrays are the read-only views of the entry's bytes that decoding checked: token arrays
concatenated over the completions, cut at ``offsets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollq.schemas.arrays import Float32Array, Int32Array, UInt8Array, broadcast
from rollq.schemas.entry import split_at
from rollq.schemas.models import (
    SCHEMA_VERSION,
    Completion,
    SamplingRecord,
    ScoredGroup,
    SequenceScore,
    TrajectoryGroup,
)


@dataclass(eq=False)
class TrajectoryColumns:
    """A trajectory entry's checked values (``schemas.decoding``)."""

    identity: dict[str, Any]
    """``group_id``, ``run``, ``env``, ``policy_version``."""
    prompt_ids: Int32Array
    lengths: list[int]
    """Completion tokens of each completion."""
    offsets: list[int]
    """Where each completion's tokens start in the flat arrays, and where the last ends."""
    completion_ids: Int32Array
    logprobs: Float32Array
    loss_mask: UInt8Array
    token_versions: Int32Array | None
    """Per-token versions of all completions; None when the entry carries none."""
    texts: list[str]
    meta: dict[str, Any]
    """The validated ``meta`` document; its ``completions`` list is one dict each."""
    routed_experts: list[Any] | None = None
    """Each completion's routed experts (``[positions, layers, top_k]`` views, or None);
    None when the entry carries none (``Completion.routed_experts``)."""
    _group: TrajectoryGroup | None = field(default=None, repr=False)

    @property
    def group_id(self) -> str:
        return self.identity["group_id"]  # type: ignore[no-any-return]

    @property
    def run(self) -> str:
        return self.identity["run"]  # type: ignore[no-any-return]

    @property
    def env(self) -> str:
        return self.identity["env"]  # type: ignore[no-any-return]

    @property
    def policy_version(self) -> int:
        return self.identity["policy_version"]  # type: ignore[no-any-return]

    def completion_versions(self) -> list[int]:
        """The policy version each completion's generation started under."""
        return [info["policy_version"] for info in self.meta["completions"]]

    def sampling(self) -> list[SamplingRecord | None]:
        """How each completion was sampled (None where not recorded)."""
        return [info["sampling"] for info in self.meta["completions"]]

    def group(self) -> TrajectoryGroup:
        """The ``TrajectoryGroup`` of these values (built once, then kept)."""
        if self._group is None:
            self._group = self._assemble()
        return self._group

    def _assemble(self) -> TrajectoryGroup:
        offsets = self.offsets
        ids = split_at(self.completion_ids, offsets)
        logprobs = split_at(self.logprobs, offsets)
        masks = split_at(self.loss_mask, offsets)
        versions: list[Any] = [None] * len(self.lengths)
        if self.token_versions is not None:
            versions = split_at(self.token_versions, offsets)
        meta = dict(self.meta)
        infos = meta.pop("completions")
        routed = self.routed_experts or [None] * len(self.lengths)
        completions = tuple(
            Completion.from_valid({
                "completion_ids": ids[i], "logprobs": logprobs[i], "loss_mask": masks[i],
                "token_versions": _if_changed(versions[i], info["policy_version"]),
                "text": self.texts[i], **info, "routed_experts": routed[i]})
            for i, info in enumerate(infos)
        )
        return TrajectoryGroup.from_valid({
            "v": SCHEMA_VERSION, "kind": "traj", **self.identity,
            "prompt_ids": self.prompt_ids, "completions": completions, **meta})


@dataclass(eq=False)
class ScoredColumns:
    """A scored entry's checked values, in its inline form (``schemas.decoding``)."""

    trajectory: TrajectoryColumns
    rewards: Float32Array
    """[n] each sequence's reward."""
    advantages: Float32Array
    """[n] each sequence's advantage."""
    token_advantages: Float32Array | None
    """Per-token advantages of all completions; None where each is its sequence's
    advantage broadcast (the entry carries none)."""
    token_rewards: Float32Array | None
    score_meta: dict[str, Any]
    """The validated ``score_meta`` document; its ``components`` list is one map each."""
    _group: ScoredGroup | None = field(default=None, repr=False)

    @property
    def group_id(self) -> str:
        return self.trajectory.group_id

    @property
    def policy_version(self) -> int:
        return self.trajectory.policy_version

    @property
    def num_sequences(self) -> int:
        return len(self.trajectory.lengths)

    @property
    def sequence_tokens(self) -> int:
        """Prompt + completion tokens over the group's sequences, the prompt counted once
        per sequence (``TrajectoryGroup.num_tokens`` counts completion tokens only)."""
        trajectory = self.trajectory
        return len(trajectory.prompt_ids) * len(trajectory.lengths) + trajectory.offsets[-1]

    def group(self) -> ScoredGroup:
        """The ``ScoredGroup`` of these values (built once, then kept)."""
        if self._group is None:
            self._group = self._assemble()
        return self._group

    def _assemble(self) -> ScoredGroup:
        trajectory = self.trajectory
        lengths, offsets = trajectory.lengths, trajectory.offsets
        n = len(lengths)
        if self.token_advantages is not None:
            token_advantages = split_at(self.token_advantages, offsets)
        else:
            token_advantages = broadcast(self.advantages, lengths)
        token_rewards: list[Any] = [None] * n
        if self.token_rewards is not None:
            token_rewards = split_at(self.token_rewards, offsets)
        meta = dict(self.score_meta)
        components = meta.pop("components")
        rewards, advantages = self.rewards.tolist(), self.advantages.tolist()
        scores = tuple(
            SequenceScore.from_valid({
                "reward": rewards[i], "advantage": advantages[i],
                "token_advantages": token_advantages[i], "components": components[i],
                "token_rewards": token_rewards[i]})
            for i in range(n)
        )
        return ScoredGroup.from_valid({
            "v": SCHEMA_VERSION, "kind": "scored", "trajectory": trajectory.group(),
            "scores": scores, **meta})


def _if_changed(versions: Any, policy_version: Any) -> Any:
    """Per-token versions only when they differ from the sequence's version (see model)."""
    if versions is None or (len(versions) and (versions != policy_version).any()):
        return versions
    return None

