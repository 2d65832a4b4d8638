"""Data-parallel ranks: the planner's rules (table and property tests), the packed slice
each rank gets, and ``DataParallelSteps`` with N ranks as threads over one consumer."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollq.consumers.trainer import (
    DataParallelSteps,
    RankShard,
    SyncTrainerClient,
    TrainerClientSettings,
    pack_groups,
    plan_shards,
)
from rollq.consumers.trainer.ranks import shard_batch
from rollq.schemas import ConfigError
from tests.factories import make_group, score
from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, publish_many


def check_plan(lengths: Sequence[int], world_size: int, max_tokens: int | None) -> None:
    """The planner's promises, for any input it accepts."""
    plan = plan_shards(lengths, world_size, max_tokens)
    assert plan.world_size == world_size
    seen = Counter(i for rank in plan.micro_batches for micro in rank for i in micro)
    assert seen == Counter(range(len(lengths))), "every sequence exactly once"
    counts = {len(rank) for rank in plan.micro_batches}
    assert len(counts) == 1, f"micro-batch counts differ over ranks: {counts}"
    for rank, tokens in zip(plan.micro_batches, plan.tokens, strict=True):
        assert sum(lengths[i] for micro in rank for i in micro) == tokens
        for micro in rank:
            assert micro, "an empty micro-batch"
            assert list(micro) == sorted(micro)
            if max_tokens is not None and len(micro) > 1:
                assert sum(lengths[i] for i in micro) <= max_tokens, "over the token budget"
    if lengths and max_tokens is None:
        assert max(plan.tokens) - min(plan.tokens) <= max(lengths), "unbalanced ranks"
    elif lengths:  # a rank of few long sequences may have been given short ones
        assert max(plan.tokens) - min(plan.tokens) <= 2 * max(lengths), "unbalanced ranks"


CASES = [
    # (name, lengths, world size, micro-batch budget)
    ("16 groups of 4 on 8 ranks", [100 + 10 * (i % 7) for i in range(64)], 8, 300),
    ("4 groups of 8 on 8 ranks: groups split", [50 + i for i in range(32)], 8, None),
    ("4 groups of 8 on 8 ranks, budget", [50 + 3 * i for i in range(32)], 8, 150),
    ("one rank", [5, 9, 3, 7], 1, 10),
    ("a sequence over the budget is alone", [500, 20, 20, 20, 20, 20, 20, 20], 2, 100),
    ("skewed lengths", [2048, 16, 16, 16, 16, 16, 16, 16, 16, 1024, 512, 256], 4, 2048),
    ("as many sequences as ranks", [7, 3, 9, 1], 4, 4),
    ("a long sequence's rank gets short ones", [500, 20, 20, 20, 20, 20, 20, 20], 2, 100),
]


@pytest.mark.parametrize(("name", "lengths", "world_size", "max_tokens"), CASES,
                         ids=[c[0] for c in CASES])
def test_plan_keeps_its_promises(name: str, lengths: list[int], world_size: int,
                                 max_tokens: int | None) -> None:
    check_plan(lengths, world_size, max_tokens)


def test_plan_balances_tokens_not_sequences() -> None:
    plan = plan_shards([90, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2)
    assert plan.micro_batches == (((0,),), ((1, 2, 3, 4, 5, 6, 7, 8, 9),))
    assert plan.tokens == (90, 90)


def test_plan_uses_the_fewest_micro_batches_every_rank_fits() -> None:
    plan = plan_shards([40] * 8, 2, max_tokens=80)  # 160 tokens a rank: two of 80
    assert plan.micro_batches_per_rank == 2
    assert plan_shards([40] * 8, 2, max_tokens=1000).micro_batches_per_rank == 1
    # a 16-group step on 8 ranks (4 sequences each: 64) stays balanced to the token
    plan = plan_shards([128] * 64, 8, max_tokens=256)
    assert set(plan.tokens) == {1024} and plan.micro_batches_per_rank == 4


@pytest.mark.parametrize(("lengths", "world_size", "max_tokens", "match"), [
    ([10, 10, 10], 4, None, "3 sequences cannot feed 4 ranks"),
    # rank 0 gets the 100-token sequence alone, rank 1 four of 25 needing 2 micro-batches:
    # giving rank 0 a 25 leaves rank 1 three, needing 2 of <= 60 tokens... then 3 in all
    ([100, 25, 25, 25], 2, 30, "the same number"),
    ([10], 0, None, "world_size must be at least 1"),
    ([10], 1, 0, "max_tokens must be at least 1"),
])
def test_plan_refuses_what_cannot_be_split_evenly(lengths: list[int], world_size: int,
                                                  max_tokens: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_shards(lengths, world_size, max_tokens)


def test_an_empty_step_has_no_micro_batch_on_any_rank() -> None:
    plan = plan_shards([], 4, 100)
    assert plan.micro_batches == ((), (), (), ()) and plan.micro_batches_per_rank == 0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=96),
       world_size=st.integers(1, 8), max_tokens=st.none() | st.integers(1, 16_384))
def test_plan_promises_hold_for_any_step(lengths: list[int], world_size: int,
                                         max_tokens: int | None) -> None:
    try:
        plan_shards(lengths, world_size, max_tokens)
    except ValueError as exc:  # only for the two documented reasons
        assert "cannot feed" in str(exc) or "the same number" in str(exc)
        return
    check_plan(lengths, world_size, max_tokens)


def groups(n: int, group_size: int = 4) -> list[Any]:
    return [score(make_group(group_id=f"g{i}", seed=i, group_size=group_size,
                             tokens=3 + 2 * i)) for i in range(n)]


def test_a_selected_slice_is_the_packed_layout_of_those_sequences() -> None:
    batch = groups(3)
    whole = pack_groups(batch)
    part = whole.select([9, 0, 4])  # group 2's second, group 0's first, group 1's first
    single = [pack_groups([g]) for g in batch]
    expected = [single[2].select([1]), single[0].select([0]), single[1].select([0])]
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "sampler_logprobs",
                 "versions"):
        np.testing.assert_array_equal(getattr(part, name),
                                      np.concatenate([getattr(e, name) for e in expected]))
    np.testing.assert_array_equal(part.group_index, [2, 0, 1])
    np.testing.assert_array_equal(part.cu_seqlens, np.cumsum([0, *part.lengths]))
    assert part.max_seqlen == int(part.lengths.max())
    np.testing.assert_array_equal(part.targets().labels,
                                  np.concatenate([e.targets().labels for e in expected]))
    everything = whole.select(range(len(whole.lengths)))
    np.testing.assert_array_equal(everything.input_ids, whole.input_ids)


def test_shards_carry_the_step_global_trainable_tokens() -> None:
    batch = groups(4)
    packed = pack_groups(batch)
    shards = shard_batch(packed, [g.group_id for g in batch], 3, max_tokens=40)
    total = int(packed.targets().loss_mask.sum())
    assert {s.trainable_tokens for s in shards} == {total}
    assert sum(float(m.targets().loss_mask.sum()) for s in shards for m in s.micro_batches) \
        == total
    assert shards[0].loss_scale == pytest.approx(3 / total)
    for s in shards:
        for micro, indices in zip(s.micro_batches, s.sequences, strict=True):
            np.testing.assert_array_equal(micro.group_index, packed.group_index[list(indices)])
            np.testing.assert_array_equal(micro.lengths, packed.lengths[list(indices)])


class ThreadTransport:
    """N ranks as threads: rank 0's list lands in a shared slot, each rank takes its own."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slot: list[Any] = []

    def rank_view(self, rank: int) -> Any:
        transport = self

        class View:
            def __init__(self) -> None:
                self.rank, self.world_size = rank, transport.world_size

            def scatter(self, objects: list[Any] | None) -> Any:
                if rank == 0:
                    assert objects is not None
                    transport.slot = list(objects)
                transport.barrier.wait(timeout=30)
                mine = transport.slot[rank]
                # the second wait only keeps rank 0 from refilling the slot early: a rank
                # that failed right after its scatter (and aborted the barrier) may break it
                # for a rank that has its part already
                with contextlib.suppress(threading.BrokenBarrierError):
                    transport.barrier.wait(timeout=30)
                return mine

        return View()


def run_ranks(world_size: int, url: str, steps: int, state: dict[str, Any] | None = None,
              groups_per_step: int = 3, max_tokens: int | None = 64,
              check: Any = None, errors: list[BaseException] | None = None,
              ) -> tuple[list[list[RankShard]], dict[str, Any] | None]:
    """Train ``steps`` steps on ``world_size`` thread ranks; every rank's shards, and rank
    0's state after the last ack. A rank's error is raised, or, given ``errors``, every
    rank's is collected there."""
    transport = ThreadTransport(world_size)
    shards: list[list[RankShard]] = [[] for _ in range(world_size)]
    final: list[dict[str, Any] | None] = [None]
    raised: list[BaseException] = [] if errors is None else errors
    fast = TrainerClientSettings(block_ms=50, reclaim_every_s=3600.0)

    def rank_main(rank: int) -> None:
        client = (SyncTrainerClient(url, run=RUN, consumer="rank0", settings=fast).open()
                  if rank == 0 else None)
        try:
            dp = DataParallelSteps(client, groups=groups_per_step, max_tokens=max_tokens,
                                   transport=transport.rank_view(rank), check=check)
            if state is not None:
                dp.load_state(state if rank == 0 else None)
            for _ in range(steps):
                shard = dp.next_step(timeout_s=0.5)
                shards[rank].append(shard)
                dp.ack()
            final[0] = dp.state() if rank == 0 else final[0]
        except BaseException as exc:
            raised.append(exc)
            transport.barrier.abort()
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if raised and errors is None:
        raise raised[0]
    return shards, final[0]


def trained_sequences(shards: list[list[RankShard]]) -> Counter[tuple[str, int]]:
    """(group id, sequence index in the step) of every sequence any rank trained."""
    out: Counter[tuple[str, int]] = Counter()
    for rank in shards:
        for shard in rank:
            for micro, indices in zip(shard.micro_batches, shard.sequences, strict=True):
                for group, index in zip(micro.group_index.tolist(), indices, strict=True):
                    out[(shard.group_ids[group], index)] += 1
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
async def test_every_rank_gets_its_share_and_rank0_acks(
    redis_server: RedisServer, real_redis: Any, world_size: int
) -> None:
    ids = await publish_many(real_redis, 12)
    shards, _ = await _in_thread(run_ranks, world_size, redis_server.url, 5)
    steps = list(zip(*shards, strict=True))
    assert all(len({len(s.micro_batches) for s in step}) == 1 for step in steps)
    assert all(s.empty for s in steps[-1])  # the fifth step found nothing, on every rank
    trained = trained_sequences(shards)
    assert set(trained.values()) == {1}
    assert sorted({g for g, _ in trained}) == ids
    assert len(trained) == 12 * 4  # 4 completions a group
    pending = await real_redis.xpending("rollq:{test:0}:scored", "trainer")
    assert pending["pending"] == 0  # rank 0 acked every step


async def test_resume_replays_what_was_acked_after_the_checkpoint(
    redis_server: RedisServer, real_redis: Any
) -> None:
    ids = await publish_many(real_redis, 12)
    first, saved = await _in_thread(run_ranks, 2, redis_server.url, 1)
    await _in_thread(run_ranks, 2, redis_server.url, 2)  # acked, then lost with a crash
    rest, _ = await _in_thread(run_ranks, 2, redis_server.url, 4, saved)
    trained = trained_sequences(first) + trained_sequences(rest)
    assert set(trained.values()) == {1} and sorted({g for g, _ in trained}) == ids


def test_a_step_that_cannot_be_split_fails_on_every_rank(redis_server: RedisServer) -> None:
    import asyncio

    import redis.asyncio as aioredis

    async def publish() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        await client.flushall()
        await publish_many(client, 1)  # 4 sequences for 8 ranks
        await client.aclose()

    asyncio.run(publish())
    with pytest.raises((ValueError, RuntimeError), match="cannot feed 8 ranks"):
        run_ranks(8, redis_server.url, 1, groups_per_step=1)


async def test_a_batch_the_check_refuses_stops_every_rank_and_stays_pending(
    redis_server: RedisServer, real_redis: Any
) -> None:
    """``check`` (examples/torchrun_trainer.py's ``--is-correction`` refusing logprobs it
    cannot compare) runs on rank 0 before the split; its ``ConfigError`` is raised as itself
    on every rank (each exits 78, as one trainer would), and nothing is acked."""
    await publish_many(real_redis, 3)

    def refuse(batch: Any) -> None:
        raise ConfigError(f"cannot use this batch of {len(batch)} groups")

    errors: list[BaseException] = []
    shards, _ = await _in_thread(run_ranks, 2, redis_server.url, 1, None, 3, 64, refuse, errors)
    assert shards == [[], []]
    assert [type(e) for e in errors] == [ConfigError, ConfigError]
    assert {str(e) for e in errors} == {"cannot use this batch of 3 groups"}
    pending = await real_redis.xpending("rollq:{test:0}:scored", "trainer")
    assert pending["pending"] == 3


async def _in_thread(function: Any, *args: Any) -> Any:
    import asyncio

    return await asyncio.to_thread(function, *args)
