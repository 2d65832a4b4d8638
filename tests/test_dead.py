"""``rollq dead list | show`` on a real redis-server: letters are found by reason, time
and partition and shown decoded; times parse as ages or dates; and the whole command line,
requeue's refusals, dry run and confirmation prompt included. What a requeue does:
``test_dead_requeue.py``."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

import rollq.ops.dead as dead_module
from rollq.ops.cli import Exit, main
from rollq.ops.cli.dead import render_list, render_one
from rollq.ops.dead import Letter, find, letter_in_full, letters, parse_time
from rollq.producers.publisher import Publisher
from rollq.schemas import encode
from rollq.schemas.keys import stream_key
from tests.dead_helpers import NEEDS_GOLD, RUN, counters, put_letter, scorer_pass
from tests.factories import make_group, score
from tests.redis_server import RedisServer

# ------------------------------------------------------------------------------ helpers

async def cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv), {"ROLLQ_LOG_FORMAT": "console"})


# ---------------------------------------------------------------------- list and show

async def test_list_filters_by_reason_time_and_partition(
        real_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    await Publisher(real_redis, RUN, partitions=2).register()
    now_ms = int(time.time() * 1000)
    hour = 3_600_000
    written = {
        "3h": await put_letter(real_redis, partition=0, at_ms=now_ms - 3 * hour, group_id="a"),
        "2h": await put_letter(real_redis, partition=1, at_ms=now_ms - 2 * hour,
                               reason="decode_error", group_id="b"),
        "30m": await put_letter(real_redis, partition=0, at_ms=now_ms - hour // 2,
                                group_id="c"),
        "1m": await put_letter(real_redis, partition=1, at_ms=now_ms - 60_000, group_id="d"),
    }
    await real_redis.xadd(stream_key(RUN, 0, "dead"), {b"not": b"a letter"})

    def groups(found: list[Letter]) -> list[str]:
        return [item.group_id for item in found]

    with capture_logs() as logs:
        assert groups(await letters(real_redis, RUN)) == ["d", "c", "b", "a"]
    assert [e["event"] for e in logs] == ["dead_entry_unreadable"]  # skipped, not silently
    assert groups(await letters(real_redis, RUN, newest_first=False)) == ["a", "b", "c", "d"]
    assert groups(await letters(real_redis, RUN, reason="reward_error")) == ["d", "c", "a"]
    assert groups(await letters(real_redis, RUN, since=parse_time("1h"))) == ["d", "c"]
    assert groups(await letters(real_redis, RUN, until=parse_time("1h"))) == ["b", "a"]
    assert groups(await letters(real_redis, RUN, since=parse_time("150m"),
                                until=parse_time("10m"))) == ["c", "b"]
    assert groups(await letters(real_redis, RUN, partition=1)) == ["d", "b"]
    assert groups(await letters(real_redis, RUN, partition=7)) == []
    assert groups(await letters(real_redis, RUN, limit=2)) == ["d", "c"]
    assert groups(await letters(real_redis, RUN, limit=1, newest_first=False)) == ["a"]
    monkeypatch.setattr(dead_module, "_PAGE", 1)  # reads page by page, filters across pages
    assert groups(await letters(real_redis, RUN, reason="reward_error", limit=2,
                                newest_first=False)) == ["a", "c"]
    assert groups(await letters(real_redis, RUN, reason="decode_error")) == ["b"]

    [item] = await find(real_redis, RUN, written["2h"])
    assert (item.partition, item.letter.reason, item.source) == (1, "decode_error", "traj")
    assert await find(real_redis, RUN, "1-1") == []
    with pytest.raises(ValueError, match="not a stream entry id"):
        await find(real_redis, RUN, "yesterday")
    listing = render_list(await letters(real_redis, RUN))
    assert "reward_error of d second line" in listing  # one line per letter
    assert len(listing.splitlines()) == 5


async def test_show_decodes_the_payload_or_lists_its_fields(real_redis: aioredis.Redis) -> None:
    await Publisher(real_redis, RUN).register()
    now_ms = int(time.time() * 1000)
    group = make_group(run=RUN, group_id="shown", tokens=8)
    traj_id = (await real_redis.xadd(stream_key(RUN, 0, "traj"), encode(group))).decode()  # type: ignore[arg-type]
    scored_fields = encode(score(group, [1.0, 0.0, 0.0, 0.5]), trajectory_id=traj_id)
    ids = {
        "traj": await put_letter(real_redis, at_ms=now_ms - 4, payload=encode(group)),
        "scored": await put_letter(real_redis, at_ms=now_ms - 3, source="scored",
                                   payload=scored_fields),
        "garbage": await put_letter(real_redis, at_ms=now_ms - 2,
                                    payload={b"v": b"1", b"kind": b"traj", b"x": b"12345"}),
    }

    async def shown(key: str) -> dict[str, Any]:
        [item] = await find(real_redis, RUN, ids[key])
        return await letter_in_full(real_redis, item)

    traj = await shown("traj")
    assert traj["payload"]["decoded"].items() >= {
        "kind": "traj", "group_id": "shown", "completions": 4, "completion_tokens": 32}.items()
    assert traj["payload"]["fields"]["completion_ids"] == 32 * 4
    assert traj["reason"] == "reward_error" and traj["source"] == "traj"
    assert "traj group shown: env toy" in render_one(traj)

    scored = await shown("scored")  # reference form: joined with its traj entry
    assert scored["payload"]["decoded"]["rewards"] == [1.0, 0.0, 0.0, 0.5]
    assert scored["payload"]["joined_traj_entry"] == traj_id
    assert "completion_ids" not in scored["payload"]["fields"]  # the letter's own fields
    assert "rewards [1, 0, 0, 0.5]" in render_one(scored)
    await real_redis.xdel(stream_key(RUN, 0, "traj"), traj_id)
    gone = await shown("scored")
    assert gone["payload"]["decoded"] is None
    assert "reference form" in gone["payload"]["error"]

    garbage = await shown("garbage")
    assert garbage["payload"]["decoded"] is None and garbage["payload"]["error"]
    assert garbage["payload"]["fields"] == {"v": 1, "kind": 4, "x": 5}
    text = render_one(garbage)
    assert "x" in text and "5 bytes" in text and "second line" in text


def test_parse_time() -> None:
    assert parse_time("30m", now=10_000) == 10_000 - 1800
    assert parse_time("2h", now=10_000) == 10_000 - 7200
    assert parse_time("1.5d", now=200_000) == 200_000 - 1.5 * 86400
    assert parse_time("2026-01-01T00:00:00+00:00") == 1767225600
    assert parse_time("2026-01-01T01:00:00+01:00") == 1767225600
    assert parse_time("2026-01-01T00:00") == 1767225600  # no zone: UTC
    for bad in ("yesterday", "5 minutes", "-3h", ""):
        with pytest.raises(ValueError, match="neither"):
            parse_time(bad)


# ----------------------------------------------------------------------- the command line

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_the_cli(real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    for i in range(3):
        await Publisher(real_redis, RUN).publish(
            make_group(run=RUN, group_id=f"c{i}", metadata={"q": 1}))
    await scorer_pass(redis_server.url, tmp_path / "gold.yaml")
    flags = ["--redis-url", redis_server.url, "--run", RUN]
    capsys.readouterr()  # the scorer's log lines

    def out() -> str:
        return capsys.readouterr().out

    def err() -> str:
        return capsys.readouterr().err

    # list
    assert await cli("dead", "list", "--json", *flags) == Exit.OK
    listed = json.loads(out())
    assert {d["group_id"] for d in listed} == {"c0", "c1", "c2"}
    assert {(d["reason"], d["source"], d["partition"]) for d in listed} == {
        ("reward_missing_field", "traj", 0)}
    ids = [d["id"] for d in listed]
    assert await cli("dead", "list", *flags) == Exit.OK
    lines = out().splitlines()
    assert lines[0].split() == ["id", "p", "age", "reason", "group_id", "source", "detail"]
    assert len(lines) == 4 and ids[0] in lines[1] and "reward_missing_field" in lines[1]
    assert await cli("dead", "list", "--reason", "decode_error", *flags) == Exit.OK
    assert "no dead letters" in out()
    assert await cli("dead", "list", "--limit", "1", "--oldest-first", "--json", *flags) \
        == Exit.OK
    assert [d["id"] for d in json.loads(out())] == [ids[-1]]
    assert await cli("dead", "list", "--until", "1h", "--json", *flags) == Exit.OK
    assert json.loads(out()) == []
    assert await cli("dead", "list", "--since", "last tuesday", *flags) == Exit.USAGE
    assert "neither an age" in err()
    assert await cli("dead", "list", "--partition", "3", *flags) == Exit.USAGE
    assert "partitions 0..0" in err()
    assert await cli("dead", "list", "--run", "nope", "--redis-url", redis_server.url) \
        == Exit.NOT_FOUND
    assert "run 'nope' not found" in err()

    # show
    assert await cli("dead", "show", ids[0], *flags) == Exit.OK
    shown = out()
    assert "reward_missing_field" in shown and "traj group" in shown and "bytes" in shown
    assert await cli("dead", "show", ids[0], "--json", *flags) == Exit.OK
    document = json.loads(out())
    assert document["id"] == ids[0] and document["payload"]["decoded"]["kind"] == "traj"
    assert await cli("dead", "show", "1-1", *flags) == Exit.NOT_FOUND
    assert "no dead letter 1-1" in err()
    assert await cli("dead", "show", "c0", *flags) == Exit.USAGE
    assert "not a stream entry id" in err()

    # requeue: refusals and the dry run change nothing
    assert await cli("dead", "requeue", *flags) == Exit.USAGE
    assert "--all" in err()
    assert await cli("dead", "requeue", ids[0], "--all", *flags) == Exit.USAGE
    assert await cli("dead", "requeue", "1-1", "--yes", *flags) == Exit.NOT_FOUND
    assert await cli("dead", "requeue", "--all", "--dry-run", *flags) == Exit.OK
    assert "dry run, nothing changed: 3 would requeue" in out()
    assert await cli("dead", "requeue", ids[0], *flags) == Exit.USAGE  # no terminal, no --yes
    assert "stdin is not a terminal" in err()
    assert len(await letters(real_redis, RUN)) == 3
    assert "requeued" not in await counters(real_redis)

    # requeue: the confirmation prompt
    answers: list[str] = []
    monkeypatch.setattr("sys.stdin", _Terminal())
    monkeypatch.setattr("builtins.input", lambda prompt: answers.pop(0))
    answers.append("n")
    assert await cli("dead", "requeue", ids[0], *flags) == Exit.OK
    assert "nothing requeued" in out() and len(await letters(real_redis, RUN)) == 3
    answers.append("y")
    assert await cli("dead", "requeue", ids[0], *flags) == Exit.OK
    assert "1 requeued" in out() and len(await letters(real_redis, RUN)) == 2

    # requeue: --yes, --json, filters
    assert await cli("dead", "requeue", ids[1], "--yes", "--json", *flags) == Exit.OK
    [outcome] = json.loads(out())
    assert (outcome["id"], outcome["action"]) == (ids[1], "requeued")
    assert await cli("dead", "requeue", "--all", "--reason", "decode_error", "--yes",
                     *flags) == Exit.OK
    assert "no dead letters match" in out()
    assert await cli("dead", "requeue", "--all", "--since", "1h", "--yes", *flags) == Exit.OK
    assert "1 requeued" in out()
    assert await letters(real_redis, RUN) == []
    state = await counters(real_redis)
    assert (state["requeued"], state["drop:reward_missing_field"]) == (3, 0)
    assert await cli("dead", "show", ids[0], *flags) == Exit.NOT_FOUND
