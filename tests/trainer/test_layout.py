"""Padded and packed layouts equal hand-built arrays on a tiny group; targets line up."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from rollq.consumers.trainer import layout, pack_groups, pad_groups
from rollq.consumers.trainer.batch import EntryRef, build_batch
from rollq.schemas import Completion, ScoredGroup, SequenceScore, TrajectoryGroup, encode
from rollq.schemas.columns import ScoredColumns
from rollq.schemas.decoding import decode_scored_columns


def tiny_group() -> ScoredGroup:
    """Prompt [11, 12]; completion A = [21, 22(env token), 23] whose last token was made
    after a weight update (versions 3, 3, 4); completion B = [31]."""
    completions = (
        Completion(completion_ids=[21, 22, 23], logprobs=[-0.1, 0.0, -0.3],
                   loss_mask=[1, 0, 1], policy_version=3, token_versions=[3, 3, 4]),
        Completion(completion_ids=[31], logprobs=[-0.5], loss_mask=[1], policy_version=3),
    )
    group = TrajectoryGroup(group_id="tiny", run="test", env="toy", policy_version=3,
                            prompt_ids=[11, 12], completions=completions)
    return ScoredGroup(trajectory=group, scores=(
        SequenceScore(reward=1.0, advantage=0.5, token_advantages=[0.5, 0.5, 0.5]),
        SequenceScore(reward=0.0, advantage=-0.5, token_advantages=[-0.5]),
    ))


def test_padded_layout_is_aligned_to_tokens() -> None:
    p = pad_groups([tiny_group()], pad_token_id=99)
    np.testing.assert_array_equal(p.input_ids, [[11, 12, 21, 22, 23], [11, 12, 31, 99, 99]])
    np.testing.assert_array_equal(p.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(p.position_ids, [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])
    np.testing.assert_array_equal(p.loss_mask, [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]])
    np.testing.assert_allclose(p.advantages, [[0, 0, .5, .5, .5], [0, 0, -.5, 0, 0]])
    np.testing.assert_allclose(p.sampler_logprobs, [[0, 0, -.1, 0, -.3], [0, 0, -.5, 0, 0]])
    np.testing.assert_array_equal(p.versions, [[-1, -1, 3, 3, 4], [-1, -1, 3, -1, -1]])
    np.testing.assert_allclose(p.rewards, [1.0, 0.0])
    np.testing.assert_allclose(p.sequence_advantages, [0.5, -0.5])
    np.testing.assert_array_equal(p.group_index, [0, 0])
    np.testing.assert_array_equal(p.prompt_lengths, [2, 2])
    np.testing.assert_array_equal(p.lengths, [5, 3])
    assert p.input_ids.dtype == np.int64 and p.loss_mask.dtype == np.float32
    assert p.versions.dtype == np.int32


def test_padded_targets_shift_one_place_for_causal_lm() -> None:
    t = pad_groups([tiny_group()], pad_token_id=99).targets()
    # logits[t] predicts token t+1: position 1 (prompt's last token) predicts 21.
    np.testing.assert_array_equal(t.labels, [[12, 21, 22, 23, 0], [12, 31, 99, 99, 0]])
    np.testing.assert_array_equal(t.loss_mask, [[0, 1, 0, 1, 0], [0, 1, 0, 0, 0]])
    np.testing.assert_allclose(t.sampler_logprobs, [[0, -.1, 0, -.3, 0], [0, -.5, 0, 0, 0]])
    np.testing.assert_allclose(t.advantages, [[0, .5, .5, .5, 0], [0, -.5, 0, 0, 0]])
    np.testing.assert_array_equal(t.versions, [[-1, 3, 3, 4, -1], [-1, 3, -1, -1, -1]])
    # The trainable logprobs, summed through the mask, are exactly the generated tokens'.
    assert float((t.loss_mask * t.sampler_logprobs).sum()) == pytest.approx(-0.9)


def test_packed_layout_concatenates_without_padding() -> None:
    k = pack_groups([tiny_group()])
    np.testing.assert_array_equal(k.input_ids, [11, 12, 21, 22, 23, 11, 12, 31])
    np.testing.assert_array_equal(k.position_ids, [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(k.cu_seqlens, [0, 5, 8])
    assert k.cu_seqlens.dtype == np.int32 and k.max_seqlen == 5
    np.testing.assert_array_equal(k.loss_mask, [0, 0, 1, 0, 1, 0, 0, 1])
    np.testing.assert_allclose(k.advantages, [0, 0, .5, .5, .5, 0, 0, -.5])
    np.testing.assert_allclose(k.sampler_logprobs, [0, 0, -.1, 0, -.3, 0, 0, -.5])
    np.testing.assert_array_equal(k.versions, [-1, -1, 3, 3, 4, -1, -1, 3])
    t = k.targets()
    # The last token of each sequence predicts nothing: no label leaks across the boundary.
    np.testing.assert_array_equal(t.labels, [12, 21, 22, 23, 0, 12, 31, 0])
    np.testing.assert_array_equal(t.loss_mask, [0, 1, 0, 1, 0, 0, 1, 0])


def test_packed_and_padded_agree_on_real_tokens() -> None:
    groups = [tiny_group(), tiny_group()]
    p, k = pad_groups(groups), pack_groups(groups)
    real = p.attention_mask.astype(bool)
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "sampler_logprobs",
                 "versions"):
        np.testing.assert_array_equal(getattr(p, name)[real], getattr(k, name), err_msg=name)
    np.testing.assert_array_equal(p.group_index, [0, 0, 1, 1])


def random_group(rng: np.random.Generator, name: str, max_len: int,
                 min_completions: int = 1) -> ScoredGroup:
    """A group of min_completions-5 completions of 1..max_len tokens, some with per-token
    versions and per-token advantages, a prompt of 0-7 tokens."""
    completions, scores = [], []
    for _ in range(int(rng.integers(min_completions, 6))):
        n = int(rng.integers(1, max_len + 1))
        versions = rng.integers(2, 5, n).tolist() if rng.random() < 0.5 else None
        completions.append(Completion(
            completion_ids=rng.integers(1, 500, n).tolist(),
            logprobs=(-rng.random(n)).tolist(), loss_mask=rng.integers(0, 2, n).tolist(),
            policy_version=2, token_versions=versions))
        advantage = float(rng.normal())
        token_advantages = rng.normal(size=n).tolist() if rng.random() < 0.5 else [advantage] * n
        scores.append(SequenceScore(reward=float(rng.random()), advantage=advantage,
                                    token_advantages=token_advantages))
    prompt = rng.integers(1, 500, int(rng.integers(0, 8))).tolist()
    group = TrajectoryGroup(group_id=name, run="test", env="toy", policy_version=2,
                            prompt_ids=prompt, completions=tuple(completions))
    return ScoredGroup(trajectory=group, scores=tuple(scores))


def reference_rows(group: ScoredGroup, width: int, pad: int) -> dict[str, list[list[Any]]]:
    """The padded rows of ``group``, built token by token from the module docstring's
    table."""
    rows: dict[str, list[list[Any]]] = {name: [] for name in (
        "input_ids", "attention_mask", "position_ids", "loss_mask", "advantages",
        "sampler_logprobs", "versions")}
    prompt = list(group.trajectory.prompt_ids)
    for c, score in zip(group.trajectory.completions, group.scores, strict=True):
        n = len(c.completion_ids)
        tail = width - len(prompt) - n
        versions = list(c.token_versions) if c.token_versions is not None else [
            c.policy_version] * n
        rows["input_ids"].append(prompt + list(c.completion_ids) + [pad] * tail)
        rows["attention_mask"].append([1] * (len(prompt) + n) + [0] * tail)
        rows["position_ids"].append(list(range(len(prompt) + n)) + [0] * tail)
        rows["loss_mask"].append([0] * len(prompt) + list(c.loss_mask) + [0] * tail)
        rows["advantages"].append([0] * len(prompt) + list(score.token_advantages)
                                  + [0] * tail)
        rows["sampler_logprobs"].append([0] * len(prompt) + list(c.logprobs) + [0] * tail)
        rows["versions"].append([-1] * len(prompt) + versions + [-1] * tail)
    return rows


def as_columns(group: ScoredGroup) -> ScoredColumns:
    """The group as a trainer holds it: its entry's bytes, decoded to columns."""
    return decode_scored_columns(encode(group))


@pytest.mark.parametrize("source", ["groups", "columns"])
@pytest.mark.parametrize("large", [False, True], ids=["ufuncs", "row-writes"])
def test_padded_layout_equals_a_token_by_token_reference(large: bool, source: str) -> None:
    # pad_groups leaves most of its block unzeroed: dirty freed memory must never show.
    # From columns, the entry carries per-token versions (advantages) for every completion
    # when one completion has its own, and none when none has: both ways of writing each.
    rng = np.random.default_rng(int(large))
    for trial in range(6):
        np.full(1 << 22, 7, np.int64)  # a dirty block freed just before: malloc reuses it
        groups = ([random_group(rng, f"g{trial}-{i}", 3000, min_completions=4)
                   for i in range(8)] if large else
                  [random_group(rng, f"g{trial}-{i}", 40) for i in range(int(rng.integers(1, 5)))])
        pad = int(rng.integers(0, 3))
        laid: list[Any] = groups if source == "groups" else [as_columns(g) for g in groups]
        p = pad_groups(laid, pad_token_id=pad)
        assert (p.input_ids.size >= layout._SMALL_PADDED) == large  # the path under test
        width = int(p.lengths.max())
        expected: dict[str, list[list[Any]]] = {}
        for group in groups:
            for name, rows in reference_rows(group, width, pad).items():
                expected.setdefault(name, []).extend(rows)
        for name, rows in expected.items():
            np.testing.assert_allclose(getattr(p, name), np.asarray(rows), rtol=1e-6,
                                       err_msg=f"{name}, trial {trial}")
        k = pack_groups(laid)
        real = p.attention_mask.astype(bool)
        for name in expected:
            if name != "attention_mask":
                np.testing.assert_array_equal(getattr(k, name), getattr(p, name)[real],
                                              err_msg=f"packed {name}, trial {trial}")


def test_empty_layouts() -> None:
    p, k = pad_groups([]), pack_groups([])
    assert p.input_ids.shape == (0, 0) and p.targets().labels.shape == (0, 0)
    assert k.input_ids.shape == (0,) and list(k.cu_seqlens) == [0] and k.max_seqlen == 0


class _NoAck:
    async def ack(self, batch: object) -> int:
        return 0


def test_to_torch_converts_every_array() -> None:
    torch = pytest.importorskip("torch")
    batch = build_batch([tiny_group()], [EntryRef("s", "1-0")], _NoAck(), pad_token_id=0)
    tensors = batch.to_torch()
    assert tensors["input_ids"].dtype == torch.int64 and tensors["input_ids"].shape == (2, 5)
    assert tensors["loss_mask"].dtype == torch.float32
    assert "groups" not in tensors and "acker" not in tensors
    packed = batch.pack().to_torch()
    assert packed["cu_seqlens"].dtype == torch.int32 and packed["max_seqlen"] == 5
    assert batch.group_ids == ["tiny"] and batch.entry_ids == ["1-0"]
    assert len(batch) == 1 and batch.num_sequences == 2 and batch.num_tokens == 8


def test_to_torch_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    batch = build_batch([tiny_group()], [EntryRef("s", "1-0")], _NoAck(), pad_token_id=0)
    with pytest.raises(ImportError, match="needs PyTorch"):
        batch.to_torch()
