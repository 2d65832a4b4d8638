"""Atropos envs as rollq envs (``producers.envs.atropos``) and atroposlib's ``/generate``
on stock vLLM (``producers.inference.capture.generate``, the API's ``/inference`` routes),
on the fake vLLM: drawn items recorded per job, the group mapping, token exactness,
failures. The real CPU vLLM runs them in ``tests/integration/test_atropos_vllm.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.ops.atropos.app import create_app
from rollq.ops.settings import AtroposApiSettings
from rollq.producers.drawn import ItemLedger
from rollq.producers.envs.base import Item, Rollout
from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.rollout import PolicyVersionSource, RolloutRunner
from rollq.schemas import Completion, InferenceUnavailable, decode_trajectory
from rollq.schemas.keys import stream_key
from rollq.schemas.tagged import decode_tagged, encode_tagged
from tests.producers.fake_vllm import FakeVLLM, fake_transport

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")

from rollq.producers.envs.atropos import (
    EnvSkipped,
    served_logprobs,
)
from rollq.producers.envs.registry import make_env

ENVS = "tests.atropos.atropos_envs"


@pytest.fixture
def tokenizer_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from rollq.ops.local.tiny_model import _write_tokenizer

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    _write_tokenizer(directory, seed=0)
    monkeypatch.setenv("ROLLQ_TEST_TOKENIZER", str(directory))
    monkeypatch.setenv("ROLLQ_TEST_OPENAI_URL", "http://127.0.0.1:9/v1")
    return directory


@pytest.fixture
async def pool() -> AsyncIterator[tuple[InferencePool, FakeVLLM]]:
    fake = FakeVLLM()
    async with InferencePool([fake.base_url], transport=fake_transport(fake),
                             max_retries=0, health_interval_s=None) as client:
        yield client, fake


async def version() -> int:
    return 7


def test_items_round_trip_with_their_python_types() -> None:
    item = {"q": (1, 2), "tags": frozenset({"a", "b"}), "seen": {3}, "raw": b"\x00\xff",
            "by_pair": {(1, 2): [np.int64(4)]}, "__rollq__": None, "plain": [1.5, None, "x"]}
    encoded = encode_tagged(item)
    assert decode_tagged(encoded) == {**item, "by_pair": {(1, 2): [4]}}
    with pytest.raises(Exception, match="cannot record"):
        encode_tagged(object())


async def test_a_drawn_item_is_recorded_once_per_job(redis: aioredis.Redis) -> None:
    ledger = ItemLedger(redis, "led")
    draws = iter([{"n": 1}, {"n": 2}])

    async def draw() -> dict[str, Any]:
        return next(draws)

    assert await ledger.item("led:e:0", draw) == ({"n": 1}, True)
    assert await ledger.item("led:e:0", draw) == ({"n": 1}, False)  # the re-run's item
    assert await ledger.item("led:e:1", draw) == ({"n": 2}, True)
    await ledger.forget("led:e:0")
    assert await redis.exists(ledger.key("led:e:0")) == 0
    assert 0 < await redis.ttl(ledger.key("led:e:1"))


class CountingEnv:
    """A ``DrawingEnv`` whose source moves on at every draw; its first rollout fails."""

    name = "counting"

    def __init__(self) -> None:
        self.cursor = 0
        self.rolled: list[int] = []

    def __len__(self) -> int:
        return 10**9

    def item(self, index: int) -> Item:
        return Item(index=index, fields={})

    async def draw(self) -> dict[str, Any]:
        self.cursor += 1
        return {"n": self.cursor}

    async def rollout(self, item: Item, pool: Any, **_: Any) -> Rollout:
        self.rolled.append(item.fields["n"])
        if len(self.rolled) == 1:
            raise InferenceUnavailable("the first try fails after the draw")
        return Rollout(prompt_ids=[1], completions=[Completion(
            completion_ids=[2], logprobs=[-0.5], loss_mask=[1], policy_version=0)])


async def test_a_rerun_of_a_job_rolls_the_item_its_first_try_drew(
        redis: aioredis.Redis) -> None:
    env = CountingEnv()
    runner = RolloutRunner(run="rr", env=env, pool=None,  # type: ignore[arg-type]
                           publisher=Publisher(redis, "rr"), sampling=SamplingParams(),
                           group_size=1, versions=PolicyVersionSource(redis, "rr"))
    await runner.publisher.register()
    with pytest.raises(InferenceUnavailable):
        await runner.run_job("rr:counting:0", 0)
    await runner.run_job("rr:counting:1", 1)  # another job draws meanwhile
    await runner.run_job("rr:counting:0", 0)  # the retry of job 0
    assert env.rolled == [1, 2, 1]
    assert await redis.keys("rollq:{rr}:drawn:*") == []  # records go once published
    published = [decode_trajectory(f).group_id
                 for _, f in await redis.xrange(stream_key("rr", 0, "traj"))]
    assert published == ["rr:counting:1", "rr:counting:0"]


def test_token_exactness_is_a_cover_by_server_outputs() -> None:
    outputs = {(5, 6, 7): [-0.1, -0.2, -0.3], (8,): [-0.4]}
    tokens = np.array([1, 2, 5, 6, 7, 3, 8, 5, 6, 7])
    trained = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1], bool)
    found = served_logprobs(tokens, trained, outputs)
    assert found is not None
    np.testing.assert_allclose(found, [0, 0, -0.1, -0.2, -0.3, 0, -0.4, -0.1, -0.2, -0.3],
                               rtol=1e-6)
    retokenised = np.array([1, 2, 5, 6, 9, 3, 8, 5, 6, 7])
    assert served_logprobs(retokenised, trained, outputs) is None


@pytest.mark.parametrize("env_class", ["ManagedSumsEnv", "ManagedTwoStepEnv"])
async def test_managed_envs_give_token_exact_groups(
        env_class: str, tokenizer_dir: Path,
        pool: tuple[InferencePool, FakeVLLM]) -> None:
    client, _fake = pool
    env = make_env(f"atropos:{ENVS}:{env_class}", env_name="mine", items=5)
    assert env.name == "mine" and len(env) == 5
    fields = await env.draw()  # type: ignore[attr-defined]
    assert decode_tagged(fields["item"]) == (1, 1)
    rollout = await env.rollout(Item(0, fields), client, group_size=3,
                                sampling=SamplingParams(max_tokens=8), policy_version=version)
    assert len(rollout.completions) == 3
    for completion in rollout.completions:
        assert completion.info["token_exact"] is True
        assert completion.policy_version == 7
        trained = completion.logprobs[completion.loss_mask.astype(bool)]
        assert len(trained) and (trained < 0).all()  # the fake's own logprobs
    calls = 1 if env_class == "ManagedSumsEnv" else 2 * 3
    assert rollout.metadata["model_calls"] == calls
    rebuilt = rollout.metadata["atropos"]["rebuilt"]
    assert "masks" in rebuilt


async def test_env_errors_and_filters_follow_the_failure_taxonomy(
        tokenizer_dir: Path, pool: tuple[InferencePool, FakeVLLM]) -> None:
    client, fake = pool
    env = make_env(f"atropos:{ENVS}:FilteringEnv")
    fields = await env.draw()  # type: ignore[attr-defined]
    with pytest.raises(EnvSkipped, match="no group"):
        await env.rollout(Item(0, fields), client, group_size=2, sampling=SamplingParams(),
                          policy_version=version)
    fake.fail_next("503", count=100)
    with pytest.raises(InferenceUnavailable):  # the env swallowed it; the job is retried
        await env.rollout(Item(0, fields), client, group_size=2, sampling=SamplingParams(),
                          policy_version=version)


def test_unknown_config_fields_and_classes_are_config_errors(tokenizer_dir: Path) -> None:
    from rollq.schemas import ConfigError

    with pytest.raises(ConfigError, match="not fields"):
        make_env(f"atropos:{ENVS}:ManagedSumsEnv", no_such_field=1)
    with pytest.raises(ConfigError, match="not a BaseEnv"):
        make_env(f"atropos:{ENVS}:posted_digest")
    env = make_env(f"atropos:{ENVS}:ManagedSumsEnv", max_token_length=99)
    assert env.config.max_token_length == 99 and env.config.use_wandb is False  # type: ignore[attr-defined]


async def test_the_api_serves_atroposlibs_generate_on_stock_vllm(
        redis: aioredis.Redis) -> None:
    fake = FakeVLLM()
    app = create_app(AtroposApiSettings(run="inf", inference=[fake.base_url]), redis=redis,
                     transport=fake_transport(fake))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api.test") as client:
        assert (await client.get("/inference/health")).status_code == 200
        reply = (await client.post("/inference/generate", json={
            "prompt": {"prompt_token_ids": [101, 102, 103]}, "logprobs": 0, "n": 2,
            "max_tokens": 4, "temperature": 1.0, "model": "whatever"})).json()
        assert reply["prompt_token_ids"] == [101, 102, 103]
        assert len(reply["token_ids"]) == len(reply["logprobs"]) == 2
        for ids, rows, finish in zip(reply["token_ids"], reply["logprobs"],
                                     reply["finish_reasons"], strict=True):
            assert 1 <= len(ids) <= 4 and finish in ("stop", "length")
            # atroposlib's own parse of the answer (vllm_server.py)
            assert [int(next(iter(row[0]))) for row in rows] == ids
            assert all(next(iter(row[0].values())) < 0 for row in rows)
        chat = (await client.post("/inference/v1/chat/completions", json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "n": 3,
            "max_tokens": 3})).json()
        assert len(chat["choices"]) == 3  # passed through with any n
        bad = await client.post("/inference/generate", json={"prompt": []})
        assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
        fake.fail_next("503", count=100)
        down = await client.post("/inference/generate", json={"prompt": "hi"})
        assert down.status_code == 503
    plain = create_app(AtroposApiSettings(run="inf"), redis=redis)
    async with plain.router.lifespan_context(plain), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=plain), base_url="http://api.test") as client:
        assert (await client.post("/inference/generate", json={})).status_code == 404
