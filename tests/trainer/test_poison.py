"""No entry can stop the trainer: poison is dead-lettered with a reason, the rest is trained.

Before the value checks, one poison entry (a policy version of 2^31, an absurd traj
reference) crashed the client on every start, since a restart re-reads its own pending
entries first: 0 of the valid groups behind it were ever trained.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import Batch, layout
from rollq.schemas import ScoredGroup, TrajectoryGroup, decode_dead, encode, trajectory_ref
from rollq.schemas.keys import PARTITIONS_FIELD, state_key, stream_key
from tests.factories import make_group, score
from tests.trainer.helpers import RUN, client, counter, publish_scored

TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")


async def publish_raw(redis: aioredis.Redis, group: TrajectoryGroup,
                      change: dict[str, dict[bytes, bytes]]) -> None:
    """Publish a group as the worker and the scorer would, with fields of its traj and
    scored entries replaced (``change["traj"]``, ``change["scored"]``)."""
    await redis.hsetnx(state_key(RUN), PARTITIONS_FIELD, "1")
    traj_id = await redis.xadd(TRAJ, {**encode(group), **change.get("traj", {})})  # type: ignore[dict-item]
    scored = encode(score(group), trajectory_id=traj_id.decode())
    await redis.xadd(SCORED, {**scored, **change.get("scored", {})})  # type: ignore[dict-item]


def poisoned(group_id: str) -> TrajectoryGroup:
    return make_group(group_id=group_id, group_size=2, tokens=4)


POISON: dict[str, tuple[dict[str, dict[bytes, bytes]], str]] = {
    # the version the reviewer's OverflowError came from, in both entries (they must agree)
    "poison-version": ({"traj": {b"policy_version": str(2**31).encode()},
                        "scored": {b"policy_version": str(2**31).encode()}}, "decode_error"),
    "poison-ref": ({"scored": {b"traj": b"99999999999999999999999-0"}}, "trajectory_missing"),
    "poison-nan": ({"scored": {b"token_advantages": np.full(8, np.nan, "<f4").tobytes()}},
                   "decode_error"),
    "poison-layout": ({}, "unexpected_error"),  # decodes; the layout raises (patched below)
}


def assert_clean(batch: Batch) -> None:
    assert not [g for g in batch.group_ids if g.startswith("poison")]
    for array in (batch.advantages, batch.sampler_logprobs, batch.rewards):
        assert np.isfinite(array).all()
    assert batch.input_ids.min(initial=0) >= 0 and batch.versions.max(initial=0) < 2**31


async def test_restarts_over_poison_train_every_valid_group(
    redis: aioredis.Redis, layout_breaks_on: set[str]
) -> None:
    layout_breaks_on.add("poison-layout")
    valid = [f"g{i:03d}" for i in range(16)]
    names = iter(POISON)
    for i, group_id in enumerate(valid):
        if i % 4 == 0:  # poison ahead of every fourth valid group
            name = next(names)
            await publish_raw(redis, poisoned(name), POISON[name][0])
        await publish_scored(redis, make_group(group_id=group_id, seed=i))
    trained: list[str] = []
    for _ in range(5):  # five starts of the same trainer (same consumer name)
        async with client(redis, consumer="rank0") as tc:
            batch = await tc.next_batch(groups=4, timeout_s=1.0)
            assert_clean(batch)
            trained += batch.group_ids
            await batch.ack()
            taken = await tc.next_batch(groups=4, timeout_s=0.2)
            assert_clean(taken)  # ...and the process dies before acking it
    assert sorted(trained) == valid  # each valid group trained once, in spite of restarts
    letters = {decode_dead(f).source_id: decode_dead(f) for _, f in await redis.xrange(DEAD)}
    reasons = {letter.payload.get(b"group_id", b"").decode(): letter.reason
               for letter in letters.values()}
    assert reasons == {name: reason for name, (_, reason) in POISON.items()}
    assert all(letter.detail and letter.deliveries == 1 for letter in letters.values())
    # a group dead-lettered after decoding carries its entry as stored (reference form)
    (layout_letter,) = [x for x in letters.values() if x.reason == "unexpected_error"]
    assert trajectory_ref(layout_letter.payload) is not None
    assert "OverflowError" in layout_letter.detail
    assert await counter(redis, "consumed") == 16
    assert await counter(redis, "drop:decode_error") == 2
    assert (await redis.xpending(SCORED, "trainer"))["pending"] == 0


async def test_a_layout_failure_takes_only_its_own_group_out_of_the_batch(
    redis: aioredis.Redis, layout_breaks_on: set[str]
) -> None:
    layout_breaks_on.add("g001")
    for i in range(5):
        await publish_scored(redis, make_group(group_id=f"g{i:03d}", seed=i))
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=4)  # g001 fails: its place is filled by g004
        assert batch.group_ids == ["g000", "g002", "g003", "g004"]
        await batch.ack()
    (letter,) = [decode_dead(f) for _, f in await redis.xrange(DEAD)]
    assert letter.reason == "unexpected_error" and letter.payload[b"group_id"] == b"g001"


class Killed(BaseException):
    """Stands for what no handler survives: the OOM killer, a segfault in a kernel."""


async def test_an_entry_that_kills_the_trainer_is_dead_lettered_after_max_deliveries(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tokens = layout._write_tokens

    def killing(groups: list[ScoredGroup], *args: Any, **kwargs: Any) -> None:
        if any(g.group_id == "killer" for g in groups):
            raise Killed
        write_tokens(groups, *args, **kwargs)

    monkeypatch.setattr(layout, "_write_tokens", killing)
    await publish_scored(redis, make_group(group_id="killer"))
    for i in range(3):
        await publish_scored(redis, make_group(group_id=f"g{i:03d}", seed=i))
    starts = 0
    trained: list[str] = []
    while not trained and starts < 10:
        starts += 1
        try:
            async with client(redis, consumer="rank0", max_deliveries=3) as tc:
                batch = await tc.next_batch(groups=1)  # reads one entry at a time
                trained += batch.group_ids
                await batch.ack()
        except Killed:
            continue
    assert starts == 4  # killed on deliveries 1, 2 and 3; the 4th start dead-letters it
    assert trained == ["g000"]
    (letter,) = [decode_dead(f) for _, f in await redis.xrange(DEAD)]
    assert (letter.reason, letter.deliveries) == ("max_deliveries", 4)
    assert letter.payload[b"group_id"] == b"killer"
    async with client(redis, consumer="rank0") as tc:
        rest = await tc.next_batch(groups=2)
    assert rest.group_ids == ["g001", "g002"]
    assert Counter(trained + rest.group_ids) == Counter(["g000", "g001", "g002"])
