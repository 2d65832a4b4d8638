"""The stream bus: groups, forwarding, reclaim, dead letters and safe trimming.

Tests taking ``redis`` run on fakeredis and on a real redis-server; ``real_redis`` ones run
on the real server only (Lua races, idle times, trimming).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import (
    Delivery,
    ReaderSettings,
    StreamReader,
    follow,
    is_entry_id,
    join_trajectories,
    run_of_stream,
    trim_streams,
)
from rollq.consumers.stage import Drop, Forward, Stage
from rollq.producers.publisher import Publisher
from rollq.schemas import decode_dead, decode_scored, decode_trajectory, encode
from rollq.schemas.keys import counters_key, stream_key
from tests.factories import make_group, score
from tests.redis_server import RedisServer

RUN = "test"
TRAJ = stream_key(RUN, 0, "traj")
SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")


def reader(redis: aioredis.Redis, consumer: str = "c1", **settings: int) -> StreamReader:
    return StreamReader(redis, [TRAJ], "scorers", consumer,
                        ReaderSettings(block_ms=50, **settings))  # type: ignore[arg-type]


async def scored_forward(delivery: Delivery) -> Forward:
    """What the scorer forwards: the scores, naming the traj entry (reference form)."""
    group = decode_trajectory(delivery.fields)
    return Forward(encode(score(group), trajectory_id=delivery.entry_id))


async def test_group_creation_is_idempotent(redis: aioredis.Redis) -> None:
    r = reader(redis)
    await r.ensure_groups()
    await r.ensure_groups()  # BUSYGROUP is handled
    groups = await redis.xinfo_groups(TRAJ)
    assert [g["name"] for g in groups] == [b"scorers"]


async def test_late_group_sees_entries_published_before_it(redis: aioredis.Redis) -> None:
    await Publisher(redis, RUN).publish(make_group(group_id="early"))
    r = reader(redis)
    await r.ensure_groups()
    deliveries = await r.read()
    assert [decode_trajectory(d.fields).group_id for d in deliveries] == ["early"]


async def test_forward_moves_group_once_and_counts(redis: aioredis.Redis) -> None:
    group = make_group()
    await Publisher(redis, RUN).publish(group)
    r = reader(redis)
    await r.ensure_groups()
    (delivery,) = await r.read()
    fields = encode(score(group))
    first = await r.forward(delivery, "scored", fields, counter="scored")
    second = await r.forward(delivery, "scored", fields, counter="scored")
    assert first is not None and second is None
    entries = await redis.xrange(SCORED)
    assert len(entries) == 1
    assert decode_scored(entries[0][1]).group_id == group.group_id
    assert await redis.hget(counters_key(RUN, 0), "scored") == b"1"
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0


async def test_reclaim_takes_over_a_dead_consumers_entry(redis: aioredis.Redis) -> None:
    await Publisher(redis, RUN).publish(make_group(group_id="g1"))
    crashed = reader(redis, "crashed", reclaim_idle_ms=50)
    await crashed.ensure_groups()
    assert len(await crashed.read()) == 1  # ...and the consumer dies without acking
    early = reader(redis, "early", reclaim_idle_ms=600_000)
    assert await early.reclaim() == []  # not idle long enough yet
    survivor = reader(redis, "survivor", reclaim_idle_ms=50)
    await asyncio.sleep(0.1)  # a lower bound: idle for at least reclaim_idle_ms
    (delivery,) = await survivor.reclaim()
    assert delivery.deliveries == 2
    assert decode_trajectory(delivery.fields).group_id == "g1"
    await Stage(survivor, scored_forward).process([delivery])
    assert await redis.xlen(SCORED) == 1


async def test_entry_is_dead_lettered_after_max_deliveries(redis: aioredis.Redis) -> None:
    await Publisher(redis, RUN).publish(make_group(group_id="poison"))
    r = reader(redis, reclaim_idle_ms=0, max_deliveries=3)
    await r.ensure_groups()
    assert len(await r.read()) == 1  # delivery 1
    assert len(await r.reclaim()) == 1  # delivery 2
    assert len(await r.reclaim()) == 1  # delivery 3
    assert await r.reclaim() == []  # delivery 4 > max: dead-lettered instead
    (entry,) = await redis.xrange(DEAD)
    letter = decode_dead(entry[1])
    assert letter.reason == "max_deliveries"
    assert letter.deliveries == 4 and letter.source_stream == TRAJ
    assert decode_trajectory(letter.payload).group_id == "poison"
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0
    assert await redis.hget(counters_key(RUN, 0), "drop:max_deliveries") == b"1"


MALFORMED = {
    "garbage": {b"x": b"\x00\xff"},
    "unknown_version": {**encode(make_group()), b"v": b"7"},
    "truncated_ids": {**encode(make_group()), b"completion_ids": b"\x01\x02"},
    "wrong_lengths": {**encode(make_group()), b"lengths": np.array([1], "<i4").tobytes()},
    "missing_meta": {k: v for k, v in encode(make_group()).items() if k != b"meta"},
}


async def test_malformed_entries_are_dead_lettered_and_the_consumer_goes_on(
    redis: aioredis.Redis,
) -> None:
    good = make_group(group_id="good")
    for fields in MALFORMED.values():
        await redis.xadd(TRAJ, fields)  # type: ignore[arg-type]
    await Publisher(redis, RUN).publish(good)
    stage = Stage(reader(redis), scored_forward)
    assert await stage.drain() == len(MALFORMED) + 1
    letters = [decode_dead(f) for _, f in await redis.xrange(DEAD)]
    assert len(letters) == len(MALFORMED)
    reasons = {letter.detail.split(" ")[0] for letter in letters}
    assert {letter.reason for letter in letters} <= {"decode_error", "unknown_version_error"}
    assert reasons  # every letter says what was wrong
    assert all(letter.detail for letter in letters)
    assert {k: v for k, v in letters[1].payload.items()} == MALFORMED["unknown_version"]
    (scored,) = await redis.xrange(SCORED)
    [joined] = await join_trajectories(redis, [(SCORED, scored[1])])
    assert not isinstance(joined, str) and decode_scored(joined).group_id == "good"
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0


async def test_unexpected_transform_errors_are_dead_lettered_not_crash_looped(
    redis: aioredis.Redis,
) -> None:
    async def broken(delivery: Delivery) -> Forward:
        raise ZeroDivisionError("bug")

    await Publisher(redis, RUN).publish(make_group())
    stage = Stage(reader(redis), broken)
    await stage.drain()
    (entry,) = await redis.xrange(DEAD)
    assert decode_dead(entry[1]).reason == "unexpected_error"


async def test_drop_acks_and_counts_by_reason(redis: aioredis.Redis) -> None:
    async def degenerate(delivery: Delivery) -> Drop:
        return Drop("zero_variance")

    for _ in range(3):
        await Publisher(redis, RUN).publish(make_group())
    stage = Stage(reader(redis), degenerate)
    await stage.drain()
    assert stage.dropped == 3
    assert await redis.hget(counters_key(RUN, 0), "drop:zero_variance") == b"3"
    assert await redis.xlen(SCORED) == 0


async def test_forward_race_on_a_reclaimed_entry_forwards_exactly_once(
    real_redis: aioredis.Redis, redis_server: RedisServer
) -> None:
    """Consumer A stalls on entries; B reclaims them; both forward at the same moment."""
    publisher = Publisher(real_redis, RUN)
    for i in range(200):
        await publisher.publish(make_group(group_id=f"g{i}", tokens=2))
    second = aioredis.Redis.from_url(redis_server.url)
    try:
        slow = reader(real_redis, "slow", reclaim_idle_ms=20, count=200)
        fast = reader(second, "fast", reclaim_idle_ms=20, count=200)
        await slow.ensure_groups()
        taken = await slow.read()
        assert len(taken) == 200
        await asyncio.sleep(0.05)
        reclaimed = await fast.reclaim(count=200)
        assert len(reclaimed) == 200
        fields = encode(score(make_group(tokens=2)))
        results = await asyncio.gather(
            slow.forward_many([(d, fields) for d in taken], "scored", "scored"),
            fast.forward_many([(d, fields) for d in reclaimed], "scored", "scored"),
        )
    finally:
        await second.aclose()
    wins = [a is not None for a in results[0]], [b is not None for b in results[1]]
    assert all(a != b for a, b in zip(*wins, strict=True))  # exactly one winner per entry
    assert await real_redis.xlen(SCORED) == 200
    assert await real_redis.hget(counters_key(RUN, 0), "scored") == b"200"


async def test_trim_never_removes_an_unacked_entry(real_redis: aioredis.Redis) -> None:
    publisher = Publisher(real_redis, RUN)
    for i in range(10):
        await publisher.publish(make_group(group_id=f"g{i}", tokens=2))
    scorers = reader(real_redis, count=4)
    archiver = StreamReader(real_redis, [TRAJ], "archiver", "a1", ReaderSettings(block_ms=50))
    await scorers.ensure_groups()
    await archiver.ensure_groups()
    assert await scorers.trim() == 0  # nobody has acked anything

    first = await scorers.read(count=4)
    await scorers.ack(first[:2])  # g0, g1 acked; g2, g3 pending; g4.. unread by scorers
    all_archived = await archiver.read(count=10)
    await archiver.ack(all_archived)
    assert await scorers.trim() == 2  # only g0 and g1 are safe
    remaining = [decode_trajectory(f).group_id for _, f in await real_redis.xrange(TRAJ)]
    assert remaining == [f"g{i}" for i in range(2, 10)]

    await scorers.ack(first[2:])
    assert await scorers.trim() == 2  # g2, g3 acked: the floor moves to the unread g4
    assert await real_redis.xlen(TRAJ) == 6
    rest = await scorers.read(count=10)
    assert len(rest) == 6  # every unread entry is still there


async def test_trim_keeps_a_retention_window(real_redis: aioredis.Redis) -> None:
    publisher = Publisher(real_redis, RUN)
    r = reader(real_redis)
    await r.ensure_groups()
    for i in range(3):
        await publisher.publish(make_group(group_id=f"g{i}", tokens=2))
    await r.ack(await r.read())
    assert await r.trim(retention_ms=60_000) == 0  # acked, but young: kept for replay
    assert await r.trim() == 3


async def test_trim_keeps_every_trajectory_an_unconsumed_scored_entry_names(
    redis: aioredis.Redis,
) -> None:
    """Scored entries name traj entries, in any order (reclaimed groups are scored late):
    the traj floor is the oldest one named by a scored entry the trainer has not consumed."""
    publisher = Publisher(redis, RUN)
    for i in range(5):
        await publisher.publish(make_group(group_id=f"g{i}", tokens=2))
    scorers = reader(redis, count=5)
    await scorers.ensure_groups()
    by_group = {decode_trajectory(d.fields).group_id: d for d in await scorers.read()}
    for name in ("g1", "g3", "g0", "g4", "g2"):  # the order the scorers finished in
        delivery = by_group[name]
        fields = encode(score(decode_trajectory(delivery.fields)), trajectory_id=delivery.entry_id)
        assert await scorers.forward(delivery, "scored", fields) is not None
    trainer = StreamReader(redis, [SCORED], "trainer", "t1", ReaderSettings(block_ms=50),
                           join_trajectories=True)
    await trainer.ensure_groups()
    assert await trim_streams(redis, [TRAJ, SCORED]) == 0  # all acked by scorers, none trained
    await redis.xadd(SCORED, {b"v": b"1", b"kind": b"scored", b"traj": b"garbage"})  # not ours

    consumed = await trainer.read(count=3)
    assert [decode_scored(d.fields).group_id for d in consumed] == ["g1", "g3", "g0"]
    await trainer.ack(consumed)
    await trim_streams(redis, [TRAJ, SCORED])
    kept = [decode_trajectory(f).group_id for _, f in await redis.xrange(TRAJ)]
    assert kept == ["g2", "g3", "g4"]  # g4 is named first, but g2 still waits to be trained
    rest = await trainer.read(count=10)
    assert [decode_scored(d.fields).group_id for d in rest] == ["g4", "g2"]
    (letter,) = [decode_dead(f) for _, f in await redis.xrange(DEAD)]  # the garbage reference
    assert letter.reason == "trajectory_missing" and "not a stream entry id" in letter.detail
    assert letter.consumer_group == "trimmer"  # the trim took it before the trainer read it

    await trainer.ack(rest)
    await trim_streams(redis, [TRAJ, SCORED])
    assert await redis.xlen(TRAJ) == 0 and await redis.xlen(SCORED) == 0


async def test_follow_reads_without_joining_a_group(redis: aioredis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = Publisher(redis, RUN)
    await publisher.publish(make_group(group_id="old"))
    seen: list[str] = []

    async def handle(stream: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        seen.append(decode_trajectory(fields).group_id)

    pinned = asyncio.Event()  # follow pins "now" with an XREVRANGE before its first read
    xrevrange = redis.xrevrange

    async def pinning(*args: Any, **kwargs: Any) -> Any:
        try:
            return await xrevrange(*args, **kwargs)
        finally:
            pinned.set()

    monkeypatch.setattr(redis, "xrevrange", pinning)
    task = asyncio.create_task(follow(redis, [TRAJ], handle, block_ms=50, limit=2))
    await asyncio.wait_for(pinned.wait(), 120)
    await publisher.publish(make_group(group_id="new1"))
    await publisher.publish(make_group(group_id="new2"))
    assert await asyncio.wait_for(task, 5) == 2
    assert seen == ["new1", "new2"]
    assert await redis.xinfo_groups(TRAJ) == []


async def test_partitions_spread_groups_and_keep_their_hash_tag(redis: aioredis.Redis) -> None:
    publisher = Publisher(redis, "wide", partitions=4)
    for i in range(40):
        await publisher.publish(make_group(run="wide", group_id=f"g{i}", tokens=1))
    lengths = [await redis.xlen(stream_key("wide", p, "traj")) for p in range(4)]
    assert sum(lengths) == 40 and all(n > 0 for n in lengths)
    # a second publisher asking for another partition count uses the registered one
    assert await Publisher(redis, "wide", partitions=2).register() == 4


async def test_own_pending_poison_is_dead_lettered_after_max_deliveries(
    redis: aioredis.Redis,
) -> None:
    """A consumer that crashes on an entry re-reads it from its own pending list on every
    start; Redis counts those re-reads, and past max_deliveries the entry is dead-lettered
    instead of handed out again (it cannot crash-loop its consumer)."""
    await Publisher(redis, RUN).publish(make_group(group_id="poison"))
    r = reader(redis, max_deliveries=3)
    await r.ensure_groups()
    (first,) = await r.read()
    assert first.deliveries == 1
    counts = []
    for _ in range(2):  # the consumer "crashed": a new reader of the same name re-reads
        (again,) = await reader(redis, max_deliveries=3).read_own_pending()
        counts.append(again.deliveries)
    assert counts == [2, 3]
    assert await reader(redis, max_deliveries=3).read_own_pending() == []  # 4 > 3
    (entry,) = await redis.xrange(DEAD)
    letter = decode_dead(entry[1])
    assert letter.reason == "max_deliveries" and letter.deliveries == 4
    assert "delivered 4 times (max_deliveries=3)" in letter.detail
    assert decode_trajectory(letter.payload).group_id == "poison"
    assert (await redis.xpending(TRAJ, "scorers"))["pending"] == 0
    assert await redis.hget(counters_key(RUN, 0), "drop:max_deliveries") == b"1"


async def test_an_entry_of_another_run_is_dead_lettered_before_anyone_decodes_it(
    redis: aioredis.Redis,
) -> None:
    await redis.xadd(TRAJ, encode(make_group(run="other", group_id="foreign")))  # type: ignore[arg-type]
    await Publisher(redis, RUN).publish(make_group(group_id="ours"))
    r = reader(redis)
    await r.ensure_groups()
    assert [decode_trajectory(d.fields).group_id for d in await r.read()] == ["ours"]
    (entry,) = await redis.xrange(DEAD)
    letter = decode_dead(entry[1])
    assert letter.reason == "decode_error"
    assert "field 'run' is 'other'" in letter.detail and "run 'test'" in letter.detail


def test_entry_ids_must_fit_redis() -> None:
    assert is_entry_id("0-0") and is_entry_id("1700000000000-3")
    assert is_entry_id(f"{2**64 - 1}-{2**64 - 1}")
    for bad in (f"{2**64}-0", f"0-{2**64}", "99999999999999999999999-0", "\u0663-0", "1-",
                "-1", "1-2-3", "1", "", " 1-0", "1-0 ", "+1-0", "abc"):
        assert not is_entry_id(bad), bad
    assert run_of_stream(SCORED) == RUN and run_of_stream("elsewhere:traj") is None


ABSURD_REFS = [b"99999999999999999999999-0", str(2**64).encode() + b"-0", "\u0663-0".encode(),
               b"1-2-3", b"", b"\xff\xfe-0"]


async def test_absurd_or_unreadable_traj_references_are_dead_lettered_not_raised(
    redis: aioredis.Redis,
) -> None:
    """Neither an id Redis cannot parse nor an error reply to the lookup escapes the
    reader: each is that entry's ``trajectory_missing`` letter, and the rest is read."""
    good = make_group(group_id="good")
    traj_id = await redis.xadd(TRAJ, encode(good))  # type: ignore[arg-type]
    for ref in ABSURD_REFS:
        await redis.xadd(SCORED, {**encode(score(good), trajectory_id="0-1"), b"traj": ref})
    await redis.xadd(SCORED, encode(score(good), trajectory_id=traj_id.decode()))  # type: ignore[arg-type]
    # another partition whose traj key holds a string: XRANGE answers WRONGTYPE
    other_scored, other_traj = stream_key(RUN, 1, "scored"), stream_key(RUN, 1, "traj")
    await redis.set(other_traj, b"not a stream")
    await redis.xadd(other_scored, encode(score(good), trajectory_id="1-0"))  # type: ignore[arg-type]
    trainer = StreamReader(redis, [SCORED, other_scored], "trainer", "t1",
                           ReaderSettings(block_ms=50), join_trajectories=True)
    await trainer.ensure_groups()
    (delivery,) = await trainer.read(count=100)
    assert decode_scored(delivery.fields).group_id == "good"
    letters = [decode_dead(f) for key in (DEAD, stream_key(RUN, 1, "dead"))
               for _, f in await redis.xrange(key)]
    assert len(letters) == len(ABSURD_REFS) + 1
    assert {letter.reason for letter in letters} == {"trajectory_missing"}
    assert sum("not a stream entry id" in letter.detail for letter in letters) == len(ABSURD_REFS)
    (wrong_type,) = [letter for letter in letters if letter.source_stream == other_scored]
    assert "failed" in wrong_type.detail and "WRONGTYPE" in wrong_type.detail.upper()
    assert (await redis.xpending(SCORED, "trainer"))["pending"] == 1  # only the good one


@pytest.mark.parametrize("named", [
    "1-18446744073709551615",   # sequence above 2^53, which a Lua number garbles; older
    "00001-0002",               # than every entry, like this one
    "18446744073709551615-18446744073709551615",  # the largest id: newer than all
    "18446744073709551616-0",   # past uint64: not an entry id
    "1-2-3", "-", "", "1.5e+19-0", "x-1",
])
async def test_trim_dead_letters_a_scored_entry_naming_no_entry(real_redis: aioredis.Redis,
                                                                named: str) -> None:
    """A scored entry whose traj reference is huge or malformed does not break trimming
    (once, `1-18446744073709551615` made every trim fail, and every scorer exit), pins
    nothing, and is dead-lettered as trajectory_missing before a trainer reads it.
    More refs, and every script that takes ids: tests/test_id_fuzz.py."""
    publisher = Publisher(real_redis, RUN)
    for i in range(4):
        await publisher.publish(make_group(group_id=f"g{i}", tokens=2))
    scorers = reader(real_redis, count=4)
    await scorers.ensure_groups()
    await scorers.ack(await scorers.read())
    trainer = StreamReader(real_redis, [SCORED], "trainer", "t1", ReaderSettings(block_ms=50))
    await trainer.ensure_groups()
    await real_redis.xadd(SCORED, {b"v": b"1", b"kind": b"scored", b"traj": named.encode()})
    assert await trim_streams(real_redis, [TRAJ, SCORED]) == 4  # and no error
    assert await real_redis.xlen(TRAJ) == 0 and await real_redis.xlen(SCORED) == 0
    (letter,) = [decode_dead(f) for _, f in await real_redis.xrange(DEAD)]
    assert letter.reason == "trajectory_missing" and letter.payload[b"traj"] == named.encode()


async def test_trim_floor_steps_past_the_largest_sequence(real_redis: aioredis.Redis) -> None:
    """A group whose last delivered id has the largest sequence: its floor is the next
    millisecond, computed without a Lua number."""
    await real_redis.xadd(TRAJ, {b"x": b"1"}, id="5-18446744073709551614")
    await real_redis.xadd(TRAJ, {b"x": b"2"}, id="5-18446744073709551615")
    await real_redis.xadd(TRAJ, {b"x": b"3"}, id="6-0")
    await real_redis.xgroup_create(TRAJ, "scorers", id="5-18446744073709551615")
    assert await trim_streams(real_redis, [TRAJ]) == 2  # both 5-… entries were consumed
    assert [entry_id for entry_id, _ in await real_redis.xrange(TRAJ)] == [b"6-0"]
