"""Entry ids and references at the edges, through every Lua script that handles them
(issue 34: a scored entry naming ``1-18446744073709551615`` made the trim script write back
``1.8e+19`` and every scorer of the run exit).

The scripts that take entry ids or refs: the trim (``consumers.bus.trimming``: group ids
and the ``traj`` refs of scored entries), the orphan take (``consumers.bus.orphans``), the
settle scripts (``consumers.bus.settle``: ack-and-count, ack-or-undo) and the requeue claim
(``ops.dead``: a letter's ``traj`` ref). The others take no ids (feeder cursor and lease,
trainer version and seen-set, Atropos post, consumer housekeeping, API lock, the gateway
sessions' open, record, close, end and admission take: they XADD with ``*`` only).

A ref comes from an entry's bytes, so anything goes: the extremes of the id space, ids just
past it, and seeded random strings. Each must end as it should (kept when it names an
entry, dead-lettered with a reason when it cannot), and never raise.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import StreamReader, trim_streams
from rollq.consumers.bus.entries import id_order, is_entry_id
from rollq.ops.dead import letters, requeue
from rollq.schemas import decode_dead
from rollq.schemas.failures import TRAJECTORY_MISSING
from rollq.schemas.keys import counters_key, stream_key

RUN = "ids"
TRAJ, SCORED, DEAD = (stream_key(RUN, 0, name) for name in ("traj", "scored", "dead"))
MAX = "18446744073709551615"
EDGES = [
    "0-0", "0-1", f"0-{MAX}", "1-0", f"1-{MAX}", f"{MAX}-0", f"{MAX}-{MAX}",
    f"1-{int(MAX) + 1}", f"{int(MAX) + 1}-0", "9007199254740993-0", "1-9007199254740993",
    "00001-0002", "1000-0", "1000-1", "1500-7", "2000-0", "2000-1", "0999-" + MAX,
    "", "-", "1", "1-", "-1", "1-2-3", "1.5e+19-0", "1e3-0", "x-1", " 1000-0", "1000-0 ",
    "+1000-0", "1000-+1", "١٠٠٠-0", "1000_0", "1000-0\x00", "*", "$", ">", "+", "1000-*",
]
"""Refs at the edges (the traj stream below holds 1000-0, 1000-1 and 2000-0)."""
TRAJ_IDS = ["1000-0", "1000-1", "2000-0"]


def random_refs(count: int, seed: int = 34) -> list[str]:
    """Seeded random refs: digit runs of 1–22 characters around a separator, sometimes
    with a stray character (valid ids and near misses alike)."""
    rng = np.random.default_rng(seed)
    alphabet = list("0123456789") * 4 + list("-+. e*x")
    refs = []
    for _ in range(count):
        ms = "".join(rng.choice(list("0123456789"), int(rng.integers(1, 23))))
        seq = "".join(rng.choice(list("0123456789"), int(rng.integers(1, 23))))
        ref = f"{ms}-{seq}"
        if rng.random() < 0.3:
            at = int(rng.integers(0, len(ref)))
            ref = ref[:at] + str(rng.choice(alphabet)) + ref[at:]
        refs.append(ref)
    return refs


def names_an_entry(ref: str) -> bool:
    """Whether ``ref`` names an entry of the test's traj stream (byte for byte: Redis
    parses ``00001-0002`` as ``1-2``, but the join reads the ref as the trainer would)."""
    return is_entry_id(ref) and id_order(ref) in {id_order(i) for i in TRAJ_IDS}


async def fresh_streams(redis: aioredis.Redis) -> None:
    """Three traj entries, all consumed by the scorers; a trainer group that has read
    nothing of the scored stream."""
    await redis.flushall()
    for entry_id in TRAJ_IDS:
        await redis.xadd(TRAJ, {b"x": b"1"}, id=entry_id)
    await redis.xgroup_create(TRAJ, "scorers", id="$")
    await redis.xgroup_create(SCORED, "trainer", id="$", mkstream=True)


@pytest.mark.parametrize("refs", [EDGES, random_refs(150)], ids=["edges", "random"])
async def test_the_trim_keeps_or_dead_letters_any_ref(real_redis: aioredis.Redis,
                                                      refs: list[str]) -> None:
    for ref in refs:
        await fresh_streams(real_redis)
        await real_redis.xadd(SCORED, {b"v": b"1", b"kind": b"scored",
                                       b"traj": ref.encode()})
        # A ref between two entries pins the stream down to it, and then names an entry
        # older than the first: the second trim takes it. A third changes nothing.
        removed = [await trim_streams(real_redis, [TRAJ, SCORED]) for _ in range(3)]
        dead = [decode_dead(fields) for _, fields in await real_redis.xrange(DEAD)]
        drops = await real_redis.hget(counters_key(RUN, 0), f"drop:{TRAJECTORY_MISSING}")
        assert removed[2] == 0, ref
        if names_an_entry(ref):  # kept, and so is every traj entry from it on
            kept = [i for i in TRAJ_IDS if id_order(i) >= id_order(ref)]
            assert (sum(removed), dead) == (3 - len(kept), []), ref
            assert await real_redis.xlen(SCORED) == 1, ref
        else:  # pins nothing in the end; dead-lettered once, with the reason and its bytes
            assert (sum(removed), await real_redis.xlen(SCORED)) == (3, 0), ref
            assert [letter.reason for letter in dead] == [TRAJECTORY_MISSING], ref
            assert dead[0].payload[b"traj"] == ref.encode() and drops == b"1", ref


async def test_a_delivered_orphan_is_left_to_its_reader(real_redis: aioredis.Redis) -> None:
    """The trim never takes an entry a trainer was delivered: its reader dead-letters it
    (one letter, not two), and meanwhile it pins nothing."""
    await fresh_streams(real_redis)
    await real_redis.xadd(SCORED, {b"v": b"1", b"kind": b"scored", b"traj": f"1-{MAX}".encode()})
    await real_redis.xreadgroup("trainer", "t0", {SCORED: ">"})
    assert await trim_streams(real_redis, [TRAJ, SCORED]) == 3
    assert await real_redis.xlen(SCORED) == 1 and await real_redis.xlen(DEAD) == 0


@pytest.mark.parametrize("entry_id", ["0-1", f"0-{MAX}", f"1-{MAX}", f"{MAX}-0", f"{MAX}-{MAX}"])
async def test_the_settle_scripts_take_any_entry_id(real_redis: aioredis.Redis,
                                                    entry_id: str) -> None:
    """Forward (ack-or-undo) and ack-and-count on entries at the edges of the id space:
    exactly one forward wins, the loser leaves no copy, counts are exact."""
    for settle in ("forward", "drop"):
        await real_redis.flushall()
        await real_redis.xadd(TRAJ, {b"x": b"1"}, id=entry_id)
        first, second = (StreamReader(real_redis, [TRAJ], "scorers", name)
                         for name in ("s0", "s1"))
        await first.ensure_groups()
        (delivery,) = await first.read()
        if settle == "forward":
            won = await first.forward(delivery, "scored", {b"v": b"1"}, counter="forwarded")
            lost = await second.forward(delivery, "scored", {b"v": b"1"}, counter="forwarded")
            assert won is not None and lost is None
            assert await real_redis.xlen(SCORED) == 1
        else:
            assert await first.drop([delivery], "stale") == 1
            assert await second.drop([delivery], "stale") == 0
        counts = await real_redis.hgetall(counters_key(RUN, 0))
        assert list(counts.values()) == [b"1"], (settle, counts)


async def test_requeue_takes_any_ref_a_letter_names(real_redis: aioredis.Redis) -> None:
    """``rollq dead requeue`` of scored letters naming any ref: requeued when the traj
    entry is there, skipped with why otherwise; never an error."""
    await fresh_streams(real_redis)
    refs = [*EDGES, *random_refs(40, seed=7)]
    for index, ref in enumerate(refs):
        await real_redis.xadd(SCORED, {b"v": b"1", b"kind": b"scored",
                                       b"group_id": b"g%d" % index,
                                       b"traj": ref.encode()})
    for _ in range(2):  # the orphans become dead letters (see the first test)
        await trim_streams(real_redis, [TRAJ, SCORED])
    chosen = await letters(real_redis, RUN)
    outcomes = await requeue(real_redis, RUN, chosen, dedup_window_s=None)
    by_ref = {o.letter.letter.payload[b"traj"].decode(): o.action for o in outcomes}
    # 1000-0 is named and kept, so the stream keeps its ids: refs between them stay
    inside = {ref for ref in refs if is_entry_id(ref)
              and id_order(TRAJ_IDS[0]) <= id_order(ref) <= id_order(TRAJ_IDS[-1])}
    assert set(by_ref) == set(refs) - inside
    assert set(by_ref.values()) == {"skipped"}
