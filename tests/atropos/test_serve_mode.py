"""Real Atropos envs in ``serve`` mode against ``rollq atropos-api``, with nothing changed
but the URL: atroposlib's own env CLI and env loop (registration, ``/status-env``
back-pressure, gzip posts), its ``openai`` server type on a loopback fake, and the request
path of atroposlib's example trainer (``example_trainer/api.py`` in the Atropos repository:
``requests`` calls to ``/info``, ``/register`` and ``/batch``, gzip accepted by default;
the trainer itself needs torch and vLLM) consuming what they post."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, ApiProcess, Process, until
from tests.redis_server import RedisServer, free_port

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")
requests = pytest.importorskip("requests", reason="the example trainer's HTTP client")

GROUP_SIZE = 4  # tests.atropos.atropos_envs.GROUP_SIZE (not imported: it imports atroposlib)


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    from rollq.ops.local.tiny_model import (
        _write_tokenizer,  # the tiny model's tokenizer, without torch
    )

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    _write_tokenizer(directory, seed=0)
    return directory


@pytest.fixture
def stack(redis_server: RedisServer, tmp_path: Path,
          tokenizer_dir: Path) -> Iterator[tuple[ApiProcess, dict[str, str], list[Process]]]:
    port = free_port()
    fake = Process([sys.executable, "-m", "tests.atropos.fake_openai", "--port", str(port)],
                   tmp_path / "fake_openai.log")
    api = ApiProcess(redis_server.url, "serve", tmp_path / "api.log")
    children: list[Process] = [fake, api]
    fake.start()
    api.start()
    until(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).is_success)
    env = {"ROLLQ_TEST_OPENAI_URL": f"http://127.0.0.1:{port}/v1",
           "ROLLQ_TEST_TOKENIZER": str(tokenizer_dir), "WANDB_MODE": "disabled"}
    try:
        yield api, env, children
    finally:
        for child in reversed(children):
            child.stop()


def _serve(name: str, api: ApiProcess, env: dict[str, str], log: Path) -> Process:
    return Process([sys.executable, "-m", "tests.atropos.atropos_envs", name, "serve",
                    "--env.rollout_server_url", api.url], log, env)


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(tmp_path.glob("*.log")))


def _trained_runs(mask: list[int]) -> int:
    """How many separate stretches of trained (non -100) labels a sequence has."""
    runs, inside = 0, False
    for label in mask:
        if label != -100 and not inside:
            runs += 1
        inside = label != -100
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_atropos_envs_in_serve_mode_feed_an_atropos_trainer(
        stack: tuple[ApiProcess, dict[str, str], list[Process]], tmp_path: Path,
        tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    api, env, children = stack
    url = api.url
    batch_size = 2 * GROUP_SIZE
    # the example trainer's check_atropos_api, register_trainer, then get_batch in a loop
    assert requests.get(f"{url}/info", timeout=2).status_code == 200
    registered = requests.post(f"{url}/register", timeout=10,
                               json={**REGISTRATION, "batch_size": batch_size})
    registered.raise_for_status()
    assert "uuid" in registered.json()
    assert requests.get(f"{url}/batch", timeout=10).json() == {"batch": None}  # started
    for name in ("sums", "two_step"):
        child = _serve(name, api, env, tmp_path / f"env_{name}.log")
        children.append(child)
        child.start()

    groups: list[dict[str, Any]] = []

    def poll() -> bool:  # the Atropos trainer's loop: poll /batch, train, poll again
        response = requests.get(f"{url}/batch", timeout=10)
        batch = response.json()["batch"]
        if batch is not None:
            assert response.headers["content-encoding"] == "gzip"  # requests asks for it
            assert sum(len(g["tokens"]) for g in batch) == batch_size  # whole groups
            groups.extend(batch)
        return len({g["env_id"] for g in groups}) == 2 and len(groups) >= 8

    try:
        until(poll, timeout_s=400)  # env start-up imports torch: minutes on a loaded machine
    except AssertionError:
        raise AssertionError(f"the envs' groups did not come out:\n{_logs(tmp_path)}") from None
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    by_env: dict[int, list[dict[str, Any]]] = {}
    for group in groups:
        by_env.setdefault(group["env_id"], []).append(group)
        assert len(group["tokens"]) == GROUP_SIZE
        assert sorted(set(group["scores"])) == [0.0, 1.0]  # the fake alternates
        for tokens, mask, score, chat in zip(group["tokens"], group["masks"],
                                             group["scores"], group["messages"], strict=True):
            assert all(label in (-100, token) for label, token in zip(mask, tokens,
                                                                      strict=True))
            assert tokens == tokenizer.apply_chat_template(chat, return_dict=False)
            assert "####" in chat[-1]["content"]
            assert score in (0.0, 1.0)
    runs = {e: {_trained_runs(m) for g in gs for m in g["masks"]} for e, gs in by_env.items()}
    assert sorted(runs.values(), key=min) == [{1}, {2}], runs  # single-turn; two steps
    assert httpx.post(f"{url}/ack-batch", timeout=10).json()["status"] == "acked"
