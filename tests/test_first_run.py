"""The smaller first-run items of issue 32 (item 9): each one's behaviour as a user meets it.
Real redis-server where Redis is involved."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
import yaml

from rollq.consumers.trainer import SyncTrainerClient
from rollq.ops.cli import build_parser, main
from rollq.ops.cli.local import default_vllm_python
from rollq.ops.status import collect_status
from rollq.producers.order import item_index, record_seed
from rollq.producers.publisher import Publisher
from rollq.schemas import ConfigError
from rollq.schemas.keys import ADMITTED_FIELD, CONSUMED_COUNTER, counters_key, state_key, stream_key
from tests.factories import make_group
from tests.producers.test_job_failures import FlakyEnv, run_positions
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv, {"ROLLQ_LOG_FORMAT": "console"})
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out, captured.err


async def test_status_counts_an_atropos_runs_consumed_entries_as_consumed(
        real_redis: aioredis.Redis) -> None:
    """An Atropos API run's trainers read the scored stream as ``atropos``, not
    ``trainer``: status showed consumed and unconsumed both 713."""
    await Publisher(real_redis, "atr").register()
    scored = stream_key("atr", 0, "scored")
    for _ in range(3):
        await real_redis.xadd(scored, {"v": "1"})
    await real_redis.xgroup_create(scored, "atropos", id="0")
    delivered = await real_redis.xreadgroup("atropos", "api", {scored: ">"}, count=2)
    await real_redis.xack(scored, "atropos", *[i for i, _ in delivered[0][1]])
    await real_redis.hset(state_key("atr"), ADMITTED_FIELD, 3)
    await real_redis.hincrby(counters_key("atr", 0), CONSUMED_COUNTER, 2)
    accounting = (await collect_status(real_redis, "atr")).accounting
    assert accounting is not None
    assert (accounting.unconsumed, accounting.unaccounted) == (1, 0)


def test_runs_delete_dry_run_lists_a_busy_run(redis_server: RedisServer,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    client = sync_redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.sadd("rollq:runs", "busy")
    client.hset(state_key("busy"), "partitions", 1)
    client.xadd(stream_key("busy", 0, "traj"), {"v": "1"})  # written just now
    code, out, _ = run_main(["runs", "delete", "busy", "--dry-run", "--redis-url",
                             redis_server.url], capsys)
    assert code == 0
    assert stream_key("busy", 0, "traj") in out
    assert "note: a delete would be refused now" in out
    assert client.exists(stream_key("busy", 0, "traj"))  # nothing deleted
    client.close()


def test_score_burst_prints_what_it_scored(redis_server: RedisServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    reward = tmp_path / "reward.yaml"
    reward.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: drop}\n")

    async def publish() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        await client.flushall()
        publisher = Publisher(client, "burst")
        await publisher.publish(make_group(run="burst", texts=["a", "bb", "ccc", "dddd"]))
        await publisher.publish(make_group(run="burst", seed=1))  # all the same length
        await client.aclose()

    asyncio.run(publish())
    code, out, _ = run_main(["score", "--burst", "--run", "burst", "--reward-config",
                             str(reward), "--processes", "1", "--redis-url",
                             redis_server.url], capsys)
    assert code == 0
    assert out.strip() == ("scored 2 group(s) of run 'burst': 1 forwarded, 1 dropped, 0 "
                           "dead-lettered, 0 left pending")


async def test_feed_says_one_line_when_stopped(real_redis: aioredis.Redis,
                                               redis_server: RedisServer) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "feed", "--env", "sums", "--run", "fed",
        "--redis-url", redis_server.url, "--log-format", "json",
        stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    assert process.stderr is not None
    while b"jobs_admitted" not in await asyncio.wait_for(process.stderr.readline(), 60):
        pass
    process.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0
    stopped = [line for line in err.decode().splitlines() if "feeder_stopped" in line]
    assert len(stopped) == 1 and json.loads(stopped[0])["admitted"] == 16  # 8 × (1 + 1)


def test_help_lists_the_atropos_env_kind_and_metrics_port_only_on_long_running_roles(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    for name in ("workers", "feed"):
        assert "atropos:MODULE:ENVCLASS" in sub[name].format_help()
    for name in ("workers", "feed", "score", "atropos-api", "gateway"):
        assert "--metrics-port" in sub[name].format_help(), name
    for name in ("status", "tail", "rescore", "demo"):
        assert "--metrics-port" not in sub[name].format_help(), name


def test_the_demo_reads_only_the_trainers_complete_metric_rows(tmp_path: Path) -> None:
    """The follower reads metrics.jsonl while the trainer appends to it: a row caught half
    written (a CI run's demo stopped on one) waits for its newline."""
    from rollq.ops.local.demo import read_metrics

    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    row = json.dumps({"step": 1, "reward_mean": 0.5})
    path.write_text(row + "\n" + row[:20])
    assert read_metrics(path) == [{"step": 1, "reward_mean": 0.5}]
    path.write_text(row + "\n" + row + "\n")
    assert len(read_metrics(path)) == 2


def test_the_demo_finds_the_vllm_python_that_setup_makes(tmp_path: Path) -> None:
    assert default_vllm_python(tmp_path / "a", tmp_path / "b" / ".venv") is None
    python = tmp_path / "b" / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert default_vllm_python(tmp_path / "a", tmp_path / "b" / ".venv") == str(python)
    assert default_vllm_python(tmp_path / "b", tmp_path / "c") == str(python)


def test_the_demo_without_a_vllm_python_says_where_setup_puts_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    code, _, err = run_main(["demo", "--task", "sums"], capsys)
    assert code == 78
    assert "`bash .ci/setup.sh` makes .venv-vllm/bin/python" in err


def test_serve_trainer_metrics_takes_the_sync_client() -> None:
    pytest.importorskip("prometheus_client")
    import httpx

    from rollq.ops.role_metrics import serve_trainer_metrics

    client = SyncTrainerClient("redis://127.0.0.1:1/0", run="m", consumer="rank0")
    metrics, port = serve_trainer_metrics(client, 0, host="127.0.0.1")
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'rollq_trainer_batches_total{role="trainer",run="m"}' in body
    finally:
        metrics.close()


def test_compose_pins_vllm_and_leaves_the_trainer_gpu_memory() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    vllm = compose["services"]["vllm"]
    image, _, tag = vllm["image"].rpartition(":")
    assert image == "vllm/vllm-openai" and tag not in ("", "latest")
    command = vllm["command"]
    share = command[command.index("--gpu-memory-utilization") + 1]
    assert float(share.split(":-")[1].rstrip("}")) <= 0.5


def test_each_epoch_visits_every_item_once_in_its_own_seeded_order() -> None:
    items = 20
    epochs = [[item_index(e * items + i, items, seed=7) for i in range(items)]
              for e in range(3)]
    assert all(sorted(order) == list(range(items)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] == [item_index(i, items, seed=7) for i in range(items)]  # deterministic
    assert [item_index(p, items, None) for p in range(25)] == [p % items for p in range(25)]


async def test_workers_roll_out_the_item_the_runs_seed_picks(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await record_seed(real_redis, "jobs", 5)
    with pytest.raises(ConfigError, match="was fed with --shuffle-seed 5"):
        await record_seed(real_redis, "jobs", None)
    env = FlakyEnv(lambda index, call: None)
    await run_positions(redis_server.url, real_redis, env, [0, 1, 2])
    assert set(env.calls) == {item_index(p, len(env), 5) for p in range(3)}
    assert set(env.calls) != {0, 1, 2}

