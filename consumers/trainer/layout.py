"""Scored groups -> training arrays: the padded and the packed layout, and causal targets.

Every sequence is ``prompt_ids + completion_ids`` of one completion, and every per-token
array is aligned to the TOKENS: index ``t`` describes token ``t`` itself. A causal LM
predicts token ``t`` at position ``t - 1``, so the logprob of token ``t`` comes from
``logits[t - 1]``. ``targets()`` does that shift for you: it returns the same-shaped arrays
moved one place left, so ``targets().labels[t]`` is the token predicted by ``logits[t]``
and the masks, advantages, sampler logprobs and versions beside it belong to that label.
The last position of every sequence has no label; ``targets()`` gives it loss mask 0.

Values by token kind (prompt | generated | env/tool inside the completion | padding):

    loss_mask          0 | 1               | 0                     | 0
    advantages         0 | token advantage | token advantage       | 0
    sampler_logprobs   0 | sampler logprob | 0 (as stored)         | 0
    versions          -1 | policy version  | policy version        | -1

Multiply by ``loss_mask`` before reducing: it is the only authority on what is trainable.
Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rollq.schemas import ScoredGroup
from rollq.schemas.columns import ScoredColumns

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]

NO_VERSION = -1
"""``versions`` value of positions no policy generated (prompt, padding)."""


@dataclass(frozen=True, eq=False)
class Targets:
    """Per-token arrays shifted for a causal LM: position ``t`` holds what ``logits[t]``
    predicts (token ``t + 1``). Same shape as the layout they came from."""

    labels: Int64Array
    """Token to score at each position (a valid id everywhere; meaningful where
    ``loss_mask`` is 1)."""
    loss_mask: Float32Array
    advantages: Float32Array
    sampler_logprobs: Float32Array
    versions: Int32Array


@dataclass(frozen=True, eq=False)
class _PerSequence:
    rewards: Float32Array
    """[B] total reward of each sequence."""
    sequence_advantages: Float32Array
    """[B] sequence-level advantage (the per-token ones are in ``advantages``)."""
    group_index: Int64Array
    """[B] index of each sequence's group in the batch's ``groups``."""
    prompt_lengths: Int64Array
    """[B] prompt tokens of each sequence."""
    lengths: Int64Array
    """[B] tokens of each sequence, prompt + completion (without padding)."""


@dataclass(frozen=True, eq=False)
class PaddedArrays(_PerSequence):
    """The padded layout: B sequences right-padded to T = the longest one."""

    input_ids: Int64Array
    """[B, T] prompt + completion token ids; padding holds ``pad_token_id``."""
    attention_mask: Int64Array
    """[B, T] 1 on real tokens, 0 on padding."""
    position_ids: Int64Array
    """[B, T] 0..length-1 on real tokens, 0 on padding."""
    loss_mask: Float32Array
    """[B, T] 1.0 only on tokens the model generated (trainable), else 0.0."""
    advantages: Float32Array
    """[B, T] per-token advantage of each token (``SequenceScore.token_advantages``)."""
    sampler_logprobs: Float32Array
    """[B, T] the sampler's logprob of each token (``Completion.logprobs``), natural log."""
    versions: Int32Array
    """[B, T] policy version that generated each token; -1 where none did."""

    def targets(self) -> Targets:
        """The arrays shifted one place left, aligned with ``logits`` (see module doc)."""
        ends = np.arange(1, self.input_ids.shape[0] + 1) * self.input_ids.shape[1]
        return _shift_all(self.input_ids, self.loss_mask, self.advantages,
                          self.sampler_logprobs, self.versions, ends)


@dataclass(frozen=True, eq=False)
class PackedBatch(_PerSequence):
    """The packed layout: N = sum of lengths tokens back to back, no padding.

    Sequence ``i`` occupies ``[cu_seqlens[i], cu_seqlens[i + 1])``; ``position_ids``
    restart at 0 for each, which is what varlen flash-attention (and HF models given
    ``position_ids`` with batch size 1) use to keep sequences apart.
    """

    input_ids: Int64Array
    """[N] token ids of all sequences."""
    position_ids: Int64Array
    """[N] position of each token within its sequence."""
    cu_seqlens: Int32Array
    """[B + 1] cumulative sequence lengths, starting at 0 (int32, as flash-attn wants)."""
    max_seqlen: int
    """Length of the longest sequence."""
    loss_mask: Float32Array
    advantages: Float32Array
    sampler_logprobs: Float32Array
    versions: Int32Array

    def targets(self) -> Targets:
        """The arrays shifted one place left, aligned with ``logits`` (see module doc)."""
        return _shift_all(self.input_ids, self.loss_mask, self.advantages,
                          self.sampler_logprobs, self.versions, self.cu_seqlens[1:])

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The arrays as torch tensors (on ``device`` if given); needs torch installed."""
        return arrays_to_torch(array_fields(self), device)

    def select(self, sequences: Sequence[int]) -> PackedBatch:
        """The packed layout of some of these sequences, in the order given (copies).

        ``group_index`` still points into the groups this batch was laid out from, so a
        data-parallel rank can tell whose sequence it trains (``consumers.trainer.ranks``).
        """
        chosen = np.asarray(sequences, np.int64)
        lengths = self.lengths[chosen]
        cu_seqlens = np.zeros(len(chosen) + 1, np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:], dtype=np.int32)
        # flat index of every chosen token: its sequence's old start + its position in it
        moved = self.cu_seqlens[:-1].astype(np.int64)[chosen] - cu_seqlens[:-1]
        tokens = np.arange(int(cu_seqlens[-1]), dtype=np.int64) + np.repeat(moved, lengths)
        per_sequence = {name: value[chosen] for name, value in _fields(self).items()}
        return PackedBatch(**per_sequence, input_ids=self.input_ids[tokens],
                           position_ids=self.position_ids[tokens], cu_seqlens=cu_seqlens,
                           max_seqlen=int(lengths.max()) if len(lengths) else 0,
                           loss_mask=self.loss_mask[tokens], advantages=self.advantages[tokens],
                           sampler_logprobs=self.sampler_logprobs[tokens],
                           versions=self.versions[tokens])


Group = ScoredGroup | ScoredColumns
"""What the layouts take: whole scored groups, or the decoded columns of their entries
(``schemas.columns``, what ``TrainerClient`` holds: no per-completion models needed)."""


def _per_sequence(groups: Sequence[Group]) -> _PerSequence:
    rewards: list[float] = []
    advantages: list[float] = []
    index: list[int] = []
    prompt_lengths: list[int] = []
    lengths: list[int] = []
    for g, group in enumerate(groups):
        p = len(group.trajectory.prompt_ids)
        if isinstance(group, ScoredColumns):
            completions = group.trajectory.lengths
            rewards += group.rewards.tolist()
            advantages += group.advantages.tolist()
        else:
            completions = [len(c.completion_ids) for c in group.trajectory.completions]
            rewards += [score.reward for score in group.scores]
            advantages += [score.advantage for score in group.scores]
        n = len(completions)
        index += [g] * n
        prompt_lengths += [p] * n
        lengths += [p + length for length in completions]
    return _PerSequence(
        rewards=np.asarray(rewards, np.float32),
        sequence_advantages=np.asarray(advantages, np.float32),
        group_index=np.asarray(index, np.int64),
        prompt_lengths=np.asarray(prompt_lengths, np.int64),
        lengths=np.asarray(lengths, np.int64),
    )


_Row = tuple[Any, Any, Any, Any, Any]
"""One sequence's completion tokens: ids, loss mask, advantages (an array, or one value
for the whole sequence), sampler logprobs, versions (an array, or one version)."""


def _rows(group: Group) -> list[_Row]:
    """The completion token arrays of each of ``group``'s sequences."""
    rows: list[_Row] = []
    if isinstance(group, ScoredColumns):
        t = group.trajectory
        token_advantages, token_versions = group.token_advantages, t.token_versions
        sequence_advantages = group.advantages.tolist()
        policy_versions = t.completion_versions()
        for i, (a, b) in enumerate(itertools.pairwise(t.offsets)):
            rows.append((
                t.completion_ids[a:b], t.loss_mask[a:b],
                sequence_advantages[i] if token_advantages is None else token_advantages[a:b],
                t.logprobs[a:b],
                policy_versions[i] if token_versions is None else token_versions[a:b]))
        return rows
    for completion, score in zip(group.trajectory.completions, group.scores, strict=True):
        advantage = score.token_advantages
        stored = completion.token_versions
        rows.append((completion.completion_ids, completion.loss_mask,
                     advantage[0] if advantage.strides == (0,) else advantage,  # broadcast
                     completion.logprobs, completion.policy_version if stored is None else stored))
    return rows


def _write_tokens(groups: Sequence[Group], starts: Sequence[int], ids: Int64Array,
                  loss: Float32Array, advantages: Float32Array, logprobs: Float32Array,
                  versions: Int32Array, width: int | None = None) -> None:
    """Write each sequence's tokens into flat arrays from its offset in ``starts``.

    Only prompt ids and the completion span are written: the arrays must already hold the
    prompt values of the other arrays (0.0, and NO_VERSION for ``versions``). Writing
    straight into the output, rather than concatenating per-sequence rows first, halves
    the memory traffic of a batch of long sequences; a sequence advantage broadcast over
    the tokens (a stride-0 view) and a single policy version are written as scalars.
    ``width``: the row length when the sequences are rows of a padded layout (each starts
    a row, a group's rows are consecutive): a group's prompt is then written into all its
    rows at once.
    """
    i = 0
    for group in groups:
        prompt = group.trajectory.prompt_ids
        p = len(prompt)
        rows = _rows(group)
        if width is not None and p:
            first = starts[i]
            ids[first:first + len(rows) * width].reshape(len(rows), width)[:, :p] = prompt
        for completion_ids, loss_mask, token_advantages, token_logprobs, token_versions in rows:
            start = starts[i]
            begin = start + p
            end = begin + len(completion_ids)
            if width is None:
                ids[start:begin] = prompt
            ids[begin:end] = completion_ids
            loss[begin:end] = loss_mask
            advantages[begin:end] = token_advantages
            logprobs[begin:end] = token_logprobs
            versions[begin:end] = token_versions
            i += 1


_INT64_ARRAYS = 3  # ids, attention mask, positions (padded); ids, positions (packed)
_FLOAT32_ARRAYS = 3  # loss mask, advantages, sampler logprobs; + int32 versions
_SMALL_PADDED = 1 << 16
"""Below this many positions ``pad_groups`` computes the attention mask and positions with
two ufuncs; above it with a fill, a copy and a write per padded row, which is 1.6-2.8x
faster on 128 x 2304 (a ufunc casting bool to int64 runs buffered) but pays ~1 us a row."""


def _allocate(shape: tuple[int, ...], int64_arrays: int, *, zero_ids: bool = True
              ) -> tuple[list[Int64Array], list[Float32Array], Int32Array]:
    """Arrays of ``shape`` carved from one allocation: ``int64_arrays`` int64 ones, three
    float32 ones and an int32 one. Only the float32 ones and, with ``zero_ids``, the first
    int64 one (the token ids) are zeroed: the caller writes every element of the others.

    One block rather than seven: numpy backs a block this large with huge pages, so the
    first write to a fresh batch faults a few pages instead of thousands (measured: a third
    of the cost of seven separate arrays for 128 x 2304 tokens). Zeroing only the arrays
    that keep zeros (the prompt and padding of the floats, the padding of the ids) halves
    the memset of a reused block: 0.2 ms of a 128 x 2304 batch. The arrays are views: the
    block lives as long as any of them.
    """
    count = int(np.prod(shape, dtype=np.int64))
    block = np.empty(count * (8 * int64_arrays + 4 * (_FLOAT32_ARRAYS + 1)), np.uint8)
    # Layout: the int64 arrays the caller fills, then ids + floats (one zeroed span), then
    # versions; every array starts on a multiple of its item size.
    offset = 0

    def take(dtype: type[np.generic], size: int) -> Any:
        nonlocal offset
        array = block[offset:offset + count * size].view(dtype).reshape(shape)
        offset += count * size
        return array

    filled = [take(np.int64, 8) for _ in range(int64_arrays - 1)]
    ids = take(np.int64, 8)
    zeroed_from = offset - (ids.nbytes if zero_ids else 0)
    floats = [take(np.float32, 4) for _ in range(_FLOAT32_ARRAYS)]
    block[zeroed_from:offset].fill(0)
    return [ids, *filled], floats, take(np.int32, 4)


def pad_groups(groups: Sequence[Group], pad_token_id: int = 0) -> PaddedArrays:
    """Build the padded layout of ``groups``: their sequences in order, right-padded."""
    per_sequence = _per_sequence(groups)
    lengths = per_sequence.lengths
    b = len(lengths)
    t = int(lengths.max()) if b else 0
    (ids, attention, positions), (loss, advantages, logprobs), versions = _allocate(
        (b, t), _INT64_ARRAYS, zero_ids=not pad_token_id)
    if pad_token_id:
        ids.fill(pad_token_id)
    versions.fill(NO_VERSION)
    _write_tokens(groups, range(0, b * t, t or 1), ids.reshape(-1), loss.reshape(-1),
                  advantages.reshape(-1), logprobs.reshape(-1), versions.reshape(-1), width=t)
    steps = np.arange(t, dtype=np.int64)
    if b * t < _SMALL_PADDED:
        np.greater(lengths[:, None], steps, out=attention, casting="unsafe")  # 1 on real
        np.multiply(attention, steps, out=positions)
    else:
        attention.fill(1)
        positions[:] = steps
        for row, length in enumerate(lengths.tolist()):
            if length < t:
                attention[row, length:] = 0
                positions[row, length:] = 0
    return PaddedArrays(**_fields(per_sequence), input_ids=ids, attention_mask=attention,
                        position_ids=positions, loss_mask=loss, advantages=advantages,
                        sampler_logprobs=logprobs, versions=versions)


def pack_groups(groups: Sequence[Group]) -> PackedBatch:
    """Build the packed layout of ``groups``: their sequences in order, back to back."""
    per_sequence = _per_sequence(groups)
    lengths = per_sequence.lengths
    cu_seqlens = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:], dtype=np.int32)
    n = int(cu_seqlens[-1])
    # every position is a prompt or completion token: ids need no padding value
    (ids, positions), (loss, advantages, logprobs), versions = _allocate((n,), 2, zero_ids=False)
    versions.fill(NO_VERSION)
    _write_tokens(groups, cu_seqlens[:-1].tolist(), ids, loss, advantages, logprobs, versions)
    starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)
    np.subtract(np.arange(n, dtype=np.int64), starts, out=positions)
    return PackedBatch(**_fields(per_sequence), input_ids=ids, position_ids=positions,
                       cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()) if len(lengths) else 0,
                       loss_mask=loss, advantages=advantages, sampler_logprobs=logprobs,
                       versions=versions)


def _shift_all(ids: Int64Array, loss: Float32Array, advantages: Float32Array,
               logprobs: Float32Array, versions: Int32Array, ends: Any) -> Targets:
    """Shift each array one token left over its flattened view; the last position of each
    sequence (``ends - 1`` in flat indices) gets the fill value."""
    last = np.asarray(ends, np.int64) - 1

    def shift(array: np.ndarray[Any, Any], fill: float) -> Any:
        flat = array.reshape(-1)
        out = np.empty_like(flat)
        out[:-1] = flat[1:]
        if flat.size:
            out[last] = fill
        return out.reshape(array.shape)

    return Targets(labels=shift(ids, 0), loss_mask=shift(loss, 0.0),
                   advantages=shift(advantages, 0.0), sampler_logprobs=shift(logprobs, 0.0),
                   versions=shift(versions, NO_VERSION))


def _fields(obj: _PerSequence) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(_PerSequence)}


def array_fields(obj: Any) -> dict[str, Any]:
    """The numpy arrays (and ints) of a layout dataclass, by field name."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), np.ndarray | int)}


def arrays_to_torch(arrays: dict[str, Any], device: Any = None) -> dict[str, Any]:
    """Convert numpy arrays to torch tensors (ints pass through); torch is imported lazily."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "to_torch() needs PyTorch, which is not installed; install torch "
            "(e.g. `pip install 'rollq[train]'`) or use the numpy arrays directly"
        ) from exc
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        if isinstance(value, np.ndarray):
            tensor = torch.from_numpy(np.ascontiguousarray(value))
            out[name] = tensor if device is None else tensor.to(device)
        else:
            out[name] = value
    return out
