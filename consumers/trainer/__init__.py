"""The trainer SDK: rollq's one library-style API (pinned by a test).

Pull scored groups in batches, train, ack, checkpoint, publish weights::

    async with TrainerClient(redis, run="gsm8k", consumer="rank0", settings=settings) as tc:
        await tc.load_state(saved)                   # when resuming from a checkpoint
        batch = await tc.next_batch(groups=8)        # or max_tokens=65_536
        loss = step(batch.to_torch("cuda"))          # padded; batch.pack() for varlen
        await batch.ack()                            # after the optimizer step
        checkpoint(model, rollq=tc.state())
        await tc.publish_policy(step, weights_dir)   # pause, reload, reset cache, resume

``SyncTrainerClient`` offers the same calls to a plain loop; ``DataParallelSteps`` feeds
the N ranks of a torchrun trainer from one consumer (``consumers.trainer.ranks``). Array
alignment is in ``consumers.trainer.layout``; the resume design in
``consumers.trainer.client``.
"""

from rollq.consumers.trainer.batch import Batch, BatchData, EntryRef, SyncBatch
from rollq.consumers.trainer.client import TRAINER_GROUP, TrainerClient
from rollq.consumers.trainer.errors import ResumeError, WeightSyncError
from rollq.consumers.trainer.layout import (
    PackedBatch,
    PaddedArrays,
    Targets,
    pack_groups,
    pad_groups,
)
from rollq.consumers.trainer.ranks import (
    DataParallelSteps,
    RankShard,
    RankTransport,
    ShardPlan,
    TorchObjectTransport,
    init_ranks,
    plan_shards,
)
from rollq.consumers.trainer.settings import PauseMode, TrainerClientSettings
from rollq.consumers.trainer.sizing import BatchSize
from rollq.consumers.trainer.staleness import is_stale
from rollq.consumers.trainer.sync import SyncTrainerClient
from rollq.consumers.trainer.weights import PolicyPublisher

__all__ = [
    "TRAINER_GROUP",
    "Batch",
    "BatchData",
    "BatchSize",
    "DataParallelSteps",
    "EntryRef",
    "PackedBatch",
    "PaddedArrays",
    "PauseMode",
    "PolicyPublisher",
    "RankShard",
    "RankTransport",
    "ResumeError",
    "ShardPlan",
    "SyncBatch",
    "SyncTrainerClient",
    "Targets",
    "TorchObjectTransport",
    "TrainerClient",
    "TrainerClientSettings",
    "WeightSyncError",
    "init_ranks",
    "is_stale",
    "pack_groups",
    "pad_groups",
    "plan_shards",
]
