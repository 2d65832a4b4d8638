"""With log_format=json every line a role writes to stderr is one JSON object, the standard
library's loggers (arq's) included; nothing goes to stdout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.producers.publisher import Publisher
from tests.factories import make_group
from tests.redis_server import RedisServer

RUN = "jsonlogs"


async def run_role(argv: list[str], env: dict[str, str]) -> tuple[int, bytes, bytes]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", *argv, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode is not None
    return process.returncode, out, err


def json_lines(stderr: bytes) -> list[dict[str, object]]:
    lines = [line for line in stderr.decode().splitlines() if line.strip()]
    assert lines, "the role logged nothing"
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return parsed


@pytest.mark.slow
async def test_every_stderr_line_is_json(real_redis: aioredis.Redis, redis_server: RedisServer,
                                         tmp_path: Path) -> None:
    for i in range(3):
        await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id=f"g{i}"))
    config = tmp_path / "reward.yaml"
    config.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: keep}\n")
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_server.url, "ROLLQ_RUN": RUN,
           "ROLLQ_LOG_FORMAT": "json", "ROLLQ_LOG_LEVEL": "debug"}
    code, out, err = await run_role(["score", "--burst", "--reward-config", str(config)], env)
    assert code == 0 and out.decode().startswith("scored 3 group(s)")  # the result: stdout
    events = json_lines(err)
    assert {"scorer_started", "group_scored"} <= {e["event"] for e in events}
    assert all(e.get("run") == RUN for e in events)  # every line names its run
    assert {e["group_id"] for e in events if e["event"] == "group_scored"} == {
        f"g{i}" for i in range(3)}
    # arq (a standard-library logger) goes through the same renderer: a feeder whose
    # Redis is down logs arq's connection warnings, then the one-line failure.
    code, out, err = await run_role(
        ["feed", "--redis-url", "redis://127.0.0.1:1/0"], {**env, "ROLLQ_LOG_LEVEL": "info"})
    assert code == 69 and out == b""
    events = json_lines(err)
    assert events[-1]["event"] == "command_failed" and events[-1]["exit_code"] == 69
    assert any(e.get("logger") == "arq.connections" for e in events)


@pytest.mark.slow
async def test_passwords_never_reach_the_log(redis_server: RedisServer) -> None:
    url = "redis://someone:hunter2secret@127.0.0.1:1/0"
    env = {**os.environ, "ROLLQ_RUN": RUN, "ROLLQ_LOG_FORMAT": "json"}
    for argv in (["status", "--redis-url", url], ["feed", "--redis-url", url],
                 ["score", "--burst", "--redis-url", url],
                 ["workers", "--redis-url", url, "--inference", "http://127.0.0.1:9"]):
        code, out, err = await run_role(argv, env)
        assert code == 69
        assert b"hunter2secret" not in out + err, (argv, err[-500:])
