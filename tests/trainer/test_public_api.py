"""The SDK's public surface is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import rollq.consumers.trainer as sdk


def test_trainer_sdk_public_surface_is_pinned() -> None:
    assert sorted(sdk.__all__) == sorted([
        "TRAINER_GROUP", "Batch", "BatchData", "BatchSize", "DataParallelSteps", "EntryRef",
        "PackedBatch", "PaddedArrays", "PauseMode", "PolicyPublisher", "RankShard",
        "RankTransport", "ResumeError", "ShardPlan", "SyncBatch", "SyncTrainerClient",
        "Targets", "TorchObjectTransport", "TrainerClient", "TrainerClientSettings",
        "WeightSyncError", "init_ranks", "is_stale", "pack_groups", "pad_groups", "plan_shards",
    ])
    for name in sdk.__all__:
        assert hasattr(sdk, name), name


def test_sdk_errors_sit_in_the_one_tree() -> None:
    from rollq.schemas import RollqError, TransientError

    assert issubclass(sdk.WeightSyncError, RollqError)
    assert not issubclass(sdk.WeightSyncError, TransientError)
    assert issubclass(sdk.ResumeError, RollqError)
