"""Every command meets every expected failure with one line that says what to fix and the
documented exit code, never a traceback; every long-running role stops on SIGTERM, exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.ops.cli import Exit, main
from tests.redis_server import RedisServer

DOWN = "redis://127.0.0.1:1/0"
COMMANDS = {
    "status": ["status"],
    "tail": ["tail", "traj", "--count", "1"],
    "score": ["score", "--burst"],
    "feed": ["feed"],
    "workers": ["workers", "--burst"],
    "rescore": ["rescore", "--reward-config", "REWARD", "--into", "other"],
    "dead": ["dead", "list"],
    "runs": ["runs", "list"],
    "atropos-api": ["atropos-api", "--port", "0"],
}


NOT_A_BASE_URL = "is not an inference server's base URL"


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port another socket is listening on, for the block."""
    with socket.socket() as taken:
        taken.bind((host, 0))
        taken.listen()
        yield taken.getsockname()[1]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str],
             environ: dict[str, str] | None = None) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv, {"ROLLQ_LOG_FORMAT": "console", **(environ or {})})
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def argv_for(command: str, tmp_path: Path) -> list[str]:
    reward = tmp_path / "reward.yaml"
    reward.write_text("components:\n  - name: length\n    component: length_bounty\n")
    return [str(reward) if a == "REWARD" else a for a in COMMANDS[command]]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_redis_down_is_exit_69_naming_the_url(command: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main([*argv_for(command, tmp_path), "--redis-url", DOWN], capsys)
    assert code == Exit.UNAVAILABLE
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in err.splitlines()[-1]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("flags", "needle"), [
    (["--redis-url", "127.0.0.1:6379"], "is not a Redis URL"),
    (["--run", "bad name!"], "run name 'bad name!' is invalid"),
    (["--config", "/nonexistent/rollq.yaml"], "cannot read config file"),
], ids=["url-without-scheme", "bad-run-name", "missing-config"])
def test_bad_settings_are_exit_78_naming_the_field(command: str, flags: list[str],
                                                   needle: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main([*argv_for(command, tmp_path), *flags], capsys)
    assert code == Exit.CONFIG, err
    assert needle in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["workers", "--burst", "--env", "nope"], "unknown env 'nope'"),
    (["feed", "--env", "gsm8k", "--env-option", "source=/nonexistent.jsonl"], "nonexistent"),
    (["feed", "--env-option", "oops"], "expected KEY=VALUE"),
    (["score", "--burst", "--reward-config", "/nonexistent.yaml"], "nonexistent.yaml"),
    (["rescore", "--reward-config", "R", "--into", "bad name"], "run name 'bad name'"),
    (["workers", "--burst", "--inference", "127.0.0.1:8000"], NOT_A_BASE_URL),
    (["atropos-api", "--port", "0", "--inference", "ftp://vllm"], NOT_A_BASE_URL),
    (["gateway", "--port", "0", "--inference", "vllm:8000"], NOT_A_BASE_URL),
    (["gateway", "--port", "0", "--tokenizer", "/nonexistent/tokenizer"],
     "tokenizer '/nonexistent/tokenizer' cannot be loaded"),
    (["gateway", "--port", "0", "--tokenizer", "t", "--chat-template", "/nonexistent.jinja"],
     "chat template '/nonexistent.jinja': no such file"),
], ids=["unknown-env", "missing-dataset", "bad-env-option", "missing-reward-config",
        "bad-into-run", "workers-inference-url", "atropos-inference-url",
        "gateway-inference-url", "missing-tokenizer", "missing-chat-template"])
def test_bad_arguments_are_one_line_and_exit_78(argv: list[str], needle: str,
                                                redis_server: RedisServer, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    reward = tmp_path / "r.yaml"
    reward.write_text("components:\n  - name: length\n    component: length_bounty\n")
    argv = [str(reward) if a == "R" else a for a in argv]
    code, err = run_main([*argv, "--redis-url", redis_server.url], capsys)
    assert code == Exit.CONFIG, err
    assert needle in err and len(err.strip().splitlines()) == 1


SIGNALLED_WHILE_STARTING = """
import asyncio, contextlib, os, signal, sys
from fastapi import FastAPI
from rollq.ops.lifecycle import serve_http

@contextlib.asynccontextmanager
async def lifespan(app):
    os.kill(os.getpid(), signal.SIG{name})  # while the app starts: before uvicorn runs
    await asyncio.sleep(0.2)
    yield
    print("lifespan ended", flush=True)

sys.exit(asyncio.run(serve_http(FastAPI(lifespan=lifespan), "127.0.0.1", 0)))
"""


@pytest.mark.parametrize("name", ["TERM", "INT"])
async def test_a_stop_signal_while_an_http_role_starts_stops_it_with_exit_0(name: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SIGNALLED_WHILE_STARTING.format(name=name),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, out.decode()[-1000:]
    assert b"lifespan ended" in out


@pytest.mark.parametrize("command", ["gateway", "atropos-api"])
def test_a_port_in_use_is_one_line_and_exit_78(command: str, redis_server: RedisServer,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with taken_port() as port:
        code, err = run_main([command, "--port", str(port), "--redis-url", redis_server.url],
                             capsys)
    assert code == Exit.CONFIG, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_an_http_role_says_that_metrics_port_is_unused(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with taken_port() as port:  # stops it right after the warning
        code, err = run_main(["gateway", "--port", str(port), "--metrics-port", "9100"], capsys)
    assert code == Exit.CONFIG
    assert "metrics_port_ignored" in err and f"own port ({port})" in err


@pytest.mark.timeout(60)  # on a regression the role would run on
@pytest.mark.parametrize("command", [["score"], ["feed"]], ids=["score", "feed"])
def test_a_metrics_port_in_use_is_exit_78(command: list[str], redis_server: RedisServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("prometheus_client")
    with taken_port("0.0.0.0") as port:
        code, err = run_main([*command, "--metrics-port", str(port),
                              "--redis-url", redis_server.url], capsys)
    assert code == Exit.CONFIG, err
    assert f"cannot serve metrics on 0.0.0.0:{port}" in err.splitlines()[-1]


def test_a_bad_reward_config_names_the_field(redis_server: RedisServer, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    reward = tmp_path / "r.yaml"
    reward.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "    on_error: zero\n")
    code, err = run_main(["score", "--burst", "--reward-config", str(reward),
                          "--redis-url", redis_server.url], capsys)
    assert code == Exit.CONFIG
    assert "on_error" in err


@pytest.mark.slow
@pytest.mark.parametrize(("command", "started"), [
    (["score"], b"scorer_started"), (["feed", "--epochs", "1000"], b"feeder_started"),
    (["status", "--watch", "0.2"], b"run sig:"),
    (["atropos-api", "--port", "0"], b"atropos_api_started"),
    (["gateway", "--port", "0", "--model", "m", "--inference", "http://127.0.0.1:1"],
     b"gateway_started")],
    ids=["score", "feed", "status", "atropos-api", "gateway"])
async def test_roles_stop_on_sigterm_and_exit_0(command: list[str], started: bytes,
                                                redis_server: RedisServer,
                                                real_redis: aioredis.Redis) -> None:
    from rollq.producers.publisher import Publisher

    await Publisher(real_redis, "sig").register()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", *command, "--redis-url", redis_server.url,
        "--run", "sig", env={**os.environ, "ROLLQ_LOG_FORMAT": "json"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert process.stdout is not None
    seen = b""
    while started not in seen:  # its loop is running (signal handlers installed before)
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        assert line, f"exited before starting: {seen[-500:]!r}"
        seen += line
    process.send_signal(signal.SIGTERM)
    rest, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, (seen + rest)[-800:]
