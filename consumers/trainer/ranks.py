"""Data-parallel ranks: N ranks of one trainer (torchrun, DDP/FSDP) train one run.

**Rank 0 is the only consumer.** It pulls each step's batch with the ordinary
``SyncTrainerClient``, plans how the step's sequences split over the ranks
(``plan_shards``) and sends each rank its shard; ranks 1..N-1 never talk to Redis::

    rank, world_size = init_ranks("nccl", os.environ)
    steps = DataParallelSteps(client if rank == 0 else None, groups=16, max_tokens=16_384)
    steps.load_state(saved["rollq"] if rank == 0 else None)   # resuming
    for step in range(start, total):
        shard = steps.next_step()                  # this rank's micro-batches (packed)
        for i, micro in enumerate(shard.micro_batches):
            with model.no_sync() if i < len(shard.micro_batches) - 1 else nullcontext():
                loss = token_loss_sum(model, micro) * shard.loss_scale
                loss.backward()
        optimizer.step()
        steps.ack()                                # rank 0 acks; the others do nothing
        if rank == 0: checkpoint(model, rollq=steps.state())

Why one consumer rather than one per rank:

- One consumer is one ledger, one staleness verdict per step, one ack after the step and
  one ``state()`` that is the whole job's position: checkpoint/resume and exactly-once are
  exactly the single-trainer guarantees (``consumers.trainer.client``), nothing new.
- Balancing tokens needs a global view of the step's groups, which per-rank consumers do
  not have: each would pull whole groups of whatever length and the slowest rank would
  set the step time.
- A crash of any rank is a crash of the job: torchrun (``--max-restarts``) stops and
  restarts every rank; rank 0's unacked batch is still pending under the same consumer
  name, and ``load_state`` replays what was acked after the checkpoint.

The split is by SEQUENCE, not by group: advantages are already per token, so a group may
be trained on several ranks, and a 4-group step still feeds 8 ranks. Every rank gets the
same number of micro-batches, so DDP's and FSDP's collectives cannot hang on a rank that
ran out; each shard carries the step's global count of trainable tokens, so a rank scales
its summed token loss by ``loss_scale`` (= world size / global trainable tokens: DDP
averages gradients over ranks) and the step's gradient is the mean over every trainable
token of the step, as on one device.

The transport between ranks is torch.distributed's object collectives
(``TorchObjectTransport``; torch is imported only when it is used), or any
``RankTransport`` (tests pass an in-process one). Start the process group with
``init_ranks``: plain ``init_process_group`` can fail after a torchrun restart.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollq.consumers.trainer.batch import SyncBatch
from rollq.consumers.trainer.layout import PackedBatch
from rollq.consumers.trainer.sync import SyncTrainerClient
from rollq.schemas import ConfigError


@dataclass(frozen=True)
class ShardPlan:
    """Which sequences each rank trains, in which micro-batch.

    ``micro_batches[rank][i]`` lists the sequences (indices in batch order, ascending) of
    that rank's micro-batch ``i``. Every rank has the same number of micro-batches, none
    of them empty (an empty step has none on every rank).
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    tokens: tuple[int, ...]
    """Prompt + completion tokens of each rank's share."""

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0


def plan_shards(lengths: Sequence[int], world_size: int,
                max_tokens: int | None = None) -> ShardPlan:
    """Split a step's sequences (``lengths``: prompt + completion tokens of each, in batch
    order) over ``world_size`` ranks, balanced by tokens, then each rank's share into
    micro-batches of at most ``max_tokens`` tokens (None: one micro-batch per rank).

    Balance: longest sequence first, each to the rank with the fewest tokens so far (ties:
    fewer sequences, then the lower rank), so no rank ends more than the longest sequence
    above another. Micro-batches: the fewest M that every rank's share fits into, M the
    same on every rank, balanced the same way within a rank. A sequence longer than
    ``max_tokens`` is a micro-batch of its own (it is never cut). A rank whose share has
    fewer sequences than M (a few long ones) is given the shortest sequences of ranks
    that have more than M: equal micro-batch counts come before token balance.

    Raises ValueError when the sequences cannot give every rank M non-empty micro-batches
    (fewer sequences than ranks, or than ranks × the micro-batches the budget needs):
    give each step more sequences or a larger ``max_tokens``. No sequences at all is an
    empty plan (no micro-batch on any rank).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not lengths:
        return ShardPlan(micro_batches=((),) * world_size, tokens=(0,) * world_size)
    if len(lengths) < world_size:
        raise ValueError(f"{len(lengths)} sequences cannot feed {world_size} ranks: every "
                         "rank needs at least one; give each step more sequences")
    shares = _balance(range(len(lengths)), lengths, world_size)
    loads = [sum(lengths[i] for i in share) for share in shares]
    count = 1
    for _ in range(len(lengths) * world_size + len(lengths)):  # bounded; see the loop's end
        count = max(count, *(_needed(share, lengths, max_tokens) for share in shares))
        short = min(range(world_size), key=lambda r: len(shares[r]))
        if len(shares[short]) < count:  # give it the shortest sequence of a rank to spare
            donors = [r for r in range(world_size) if len(shares[r]) > count]
            if not donors:
                break
            donor = max(donors, key=lambda r: (loads[r], -r))
            moved = min(shares[donor], key=lambda i: (lengths[i], i))
            shares[donor].remove(moved)
            shares[short].append(moved)
            loads[donor] -= lengths[moved]
            loads[short] += lengths[moved]
            continue
        split = [_balance(share, lengths, count) for share in shares]
        if all(_fits(micro, lengths, max_tokens) for rank in split for micro in rank):
            return ShardPlan(micro_batches=tuple(tuple(tuple(sorted(m)) for m in rank)
                                                 for rank in split),
                             tokens=tuple(loads))
        count += 1
    raise ValueError(
        f"{len(lengths)} sequences ({sum(lengths)} tokens) cannot give {world_size} ranks "
        f"the same number ({count}) of non-empty micro-batches of <= {max_tokens} tokens; "
        "give each step more sequences or raise max_tokens")


def _fits(micro: Sequence[int], lengths: Sequence[int], max_tokens: int | None) -> bool:
    """Within the budget, or a single sequence (never cut)."""
    return max_tokens is None or len(micro) == 1 or sum(lengths[i] for i in micro) <= max_tokens


def _needed(share: Sequence[int], lengths: Sequence[int], max_tokens: int | None) -> int:
    """The fewest micro-batches ``share`` fits into, balanced as ``_balance`` does."""
    count = 1
    if max_tokens is not None:  # from a lower bound: a longer sequence is alone
        small = [lengths[i] for i in share if lengths[i] <= max_tokens]
        count = max(1, min(len(share), len(share) - len(small) + -(-sum(small) // max_tokens)))
    while count < len(share) and not all(
            _fits(micro, lengths, max_tokens) for micro in _balance(share, lengths, count)):
        count += 1
    return count


def _balance(items: Sequence[int], lengths: Sequence[int], bins: int) -> list[list[int]]:
    """``items`` (indices into ``lengths``) over ``bins`` bins: longest first, each into
    the bin with the fewest tokens (then the fewest items, then the lowest index)."""
    heap = [(0, 0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for item in sorted(items, key=lambda i: (-lengths[i], i)):
        load, count, b = heapq.heappop(heap)
        out[b].append(item)
        heapq.heappush(heap, (load + lengths[item], count + 1, b))
    return out


@dataclass(frozen=True, eq=False)
class RankShard:
    """One rank's part of a training step."""

    rank: int
    world_size: int
    micro_batches: tuple[PackedBatch, ...]
    """This rank's micro-batches, packed (``PackedBatch``: positions restart per sequence;
    ``targets()`` gives the causal labels). ``group_index`` points into ``group_ids``.
    The same count on every rank; none when the step is empty."""
    sequences: tuple[tuple[int, ...], ...]
    """The batch-order index of each sequence of each micro-batch (the step's sequences
    are its groups' completions in order)."""
    group_ids: tuple[str, ...]
    """Every group of the step (all ranks), in batch order."""
    trainable_tokens: int
    """Trainable tokens of the whole step, over every rank: the sum of
    ``targets().loss_mask`` of all its sequences."""
    tokens: int
    """Prompt + completion tokens of the whole step, over every rank."""

    @property
    def loss_scale(self) -> float:
        """Multiply this rank's SUM of per-token losses by this: ``world_size`` / global
        trainable tokens. DDP and FSDP average gradients over ranks, so the step's
        gradient is the mean over all its trainable tokens."""
        return self.world_size / max(1, self.trainable_tokens)

    @property
    def empty(self) -> bool:
        """True on every rank at once: the step has no sequences (``next_step`` timed
        out with nothing to train); skip the step, call ``next_step`` again."""
        return not self.micro_batches


def shard_batch(packed: PackedBatch, group_ids: Sequence[str], world_size: int,
                max_tokens: int | None = None) -> list[RankShard]:
    """Every rank's shard of a step laid out as ``packed`` (see ``plan_shards``)."""
    plan = plan_shards(packed.lengths.tolist(), world_size, max_tokens)
    trainable = int(packed.targets().loss_mask.sum()) if len(packed.lengths) else 0
    tokens = int(packed.lengths.sum())
    return [RankShard(rank=rank, world_size=world_size,
                      micro_batches=tuple(packed.select(micro) for micro in micro_batches),
                      sequences=micro_batches, group_ids=tuple(group_ids),
                      trainable_tokens=trainable, tokens=tokens)
            for rank, micro_batches in enumerate(plan.micro_batches)]


class RankTransport(Protocol):
    """How rank 0 hands each rank its shard."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def scatter(self, objects: list[Any] | None) -> Any:
        """Rank 0 passes one object per rank and gets its own back; the others pass None
        and get theirs. A collective: every rank calls it once per step."""


class TorchObjectTransport:
    """``RankTransport`` over torch.distributed's ``scatter_object_list`` (pickled).

    The process group must be initialised. ``group``: the group to scatter over (None:
    the default one). Under NCCL objects travel through the current CUDA device (set it
    first), or pass a gloo group made with ``new_group(backend="gloo")`` to keep them on
    the CPU. The default process-group timeout bounds how long ranks 1..N-1 wait for
    rank 0's next batch: raise it when batches may take longer to arrive.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def scatter(self, objects: list[Any] | None) -> Any:
        received: list[Any] = [None]
        source = 0 if self._group is None else self._dist.get_global_rank(self._group, 0)
        self._dist.scatter_object_list(received, objects if self._rank == 0 else None,
                                       src=source, group=self._group)
        return received[0]


def init_ranks(backend: str, environ: Mapping[str, str],
               timeout_s: float | None = None) -> tuple[int, int]:
    """``torch.distributed.init_process_group`` for a rank torchrun started, safe across
    torchrun's restarts; returns ``(rank, world_size)``. Pass ``os.environ``.

    torchrun (2.13) keeps one store for the whole job and the default process group writes
    its rendezvous keys (gloo addresses, NCCL ids) under the same names in every attempt,
    so a restarted rank can read a dead rank's address from the attempt before and fail
    (measured: half of the restarts after a SIGKILLed rank). Here every attempt
    (``TORCHELASTIC_RESTART_COUNT``) gets keys of its own. Outside torchrun this is the
    usual ``env://`` initialisation.
    """
    from datetime import timedelta

    import torch.distributed as dist

    # both are re-exported from torch._C without being declared public to type checkers
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    hosted = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # by the launcher
    store = TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]),
                     world_size=world_size, is_master=not hosted and rank == 0,
                     timeout=timeout or timedelta(minutes=30))
    dist.init_process_group(backend, store=PrefixStore(f"rollq/attempt-{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size


class DataParallelSteps:
    """The training steps of one rank of a data-parallel trainer (see the module doc).

    ``client``: rank 0's open ``SyncTrainerClient`` (the job's only consumer); None on the
    other ranks. ``groups`` / ``sequences`` / ``batch_tokens``: the size of each step's
    batch, as ``next_batch`` takes it (None for all: the client's ``batch_groups``).
    ``max_tokens``: token budget of a micro-batch (None: one micro-batch per rank).
    ``transport``: None is torch.distributed (``TorchObjectTransport``).
    ``check``: called on rank 0 with each batch before it is split (the trainer's refusal
    of a batch it cannot train on, e.g. ``correction.check_logprobs``); what it raises is
    raised on every rank, and the batch stays pending.
    """

    def __init__(self, client: SyncTrainerClient | None, *, groups: int | None = None,
                 sequences: int | None = None, batch_tokens: int | None = None,
                 max_tokens: int | None = None,
                 transport: RankTransport | None = None,
                 check: Callable[[SyncBatch], None] | None = None) -> None:
        self.transport: RankTransport = transport or TorchObjectTransport()
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        if (self.rank == 0) != (client is not None):
            raise ValueError(f"rank {self.rank}: give a client on rank 0 and only there "
                             "(rank 0 is the only consumer)")
        self.client = client
        self._size = {"groups": groups, "sequences": sequences, "max_tokens": batch_tokens}
        self.max_tokens = max_tokens
        self.check = check
        self.batch: SyncBatch | None = None
        """Rank 0: the whole batch of the current step (rewards, groups, for metrics)."""

    def next_step(self, timeout_s: float | None = None) -> RankShard:
        """This rank's part of the next step; a collective: every rank calls it.

        Rank 0 waits for a batch (``timeout_s`` as ``next_batch``: None waits for a full
        one; with a timeout the step may be partial, or empty on every rank), plans and
        scatters it. An error on rank 0 (Redis gone past its give-up time, a batch that
        cannot be split, ``check``'s refusal) is raised on every rank, so none waits
        forever for the others: a ``ConfigError`` as itself (every rank exits as a
        single-device trainer would), anything else as a ``RuntimeError`` naming it.
        """
        if self.rank != 0:
            received = self.transport.scatter(None)
            if isinstance(received, BaseException):
                raise received
            shard: RankShard = received
            return shard
        assert self.client is not None
        try:
            self.batch = self.client.next_batch(**self._size, timeout_s=timeout_s)
            if self.check is not None:
                self.check(self.batch)
            shards: list[Any] = shard_batch(self.batch.pack(), self.batch.group_ids,
                                            self.world_size, self.max_tokens)
        except Exception as exc:
            failed = exc if isinstance(exc, ConfigError) else RuntimeError(
                f"rank 0 could not make the step: {exc!r}")
            self.transport.scatter([failed] * self.world_size)
            raise
        mine: RankShard = self.transport.scatter(shards)
        return mine

    def ack(self) -> int:
        """Rank 0 acks the step's batch (call after the optimizer step: the gradient of
        every rank is in it); other ranks do nothing. Returns the entries counted."""
        if self.batch is None:
            return 0
        counted = self.batch.ack()
        self.batch = None
        return counted

    def state(self) -> dict[str, Any] | None:
        """Rank 0: the client's resume state, the whole job's position (save it with the
        checkpoint, after ``ack``). None on the other ranks."""
        return None if self.client is None else self.client.state()

    def load_state(self, state: dict[str, Any] | None) -> int:
        """Rank 0: ``SyncTrainerClient.load_state`` (before the first ``next_step``);
        other ranks do nothing and may pass None. Returns the groups to replay."""
        if self.client is None:
            return 0
        if state is None:
            raise ValueError("rank 0 needs the saved state to resume")
        return self.client.load_state(state)

