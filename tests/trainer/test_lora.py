"""``weight_sync='lora'`` (issue 44) against a recording fake of vLLM's LoRA routes: every
server loads each version under ``<lora_name>-v<step>`` while it serves (no pause), the
run's version moves only once all hold it, versions past the window are unloaded (and their
written directories deleted), and a server that refuses is named with the version left."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings, WeightSyncError
from rollq.consumers.trainer.lora import LoraAdapter
from rollq.schemas.keys import POLICY_VERSION_FIELD, adapter_version, state_key
from tests.trainer.helpers import RUN, FakeVllm

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")


def trainer(redis: aioredis.Redis, fake: FakeVllm, *urls: str, **settings: object) -> TrainerClient:
    return TrainerClient(redis, run=RUN, consumer="rank0", transport=fake.transport(),
                         settings=TrainerClientSettings(inference_urls=urls, weight_sync="lora",
                                                        new_run=True,
                                                        **settings))  # type: ignore[arg-type]


def adapter(seed: int) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    return LoraAdapter(
        config={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
        tensors={f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight":
                 torch.randn(shape, generator=generator)
                 for m in ("q_proj", "v_proj")
                 for ab, shape in (("A", (2, 8)), ("B", (8, 2)))})


async def version(redis: aioredis.Redis) -> int:
    return int(await redis.hget(state_key(RUN), POLICY_VERSION_FIELD) or -1)


async def test_every_server_loads_each_version_by_name_and_nothing_pauses(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1", "http://b:1", lora_dir=str(tmp_path),
                       max_staleness=1) as tc:
        for step in (1, 2, 3):
            assert await tc.publish_policy(step, adapter(step)) == step
        assert tc.last_sync is not None and tc.last_sync.method == "lora"
        assert tc.last_sync.paused_seconds == 0 and tc.last_sync.bytes_moved > 0
    assert fake.adapters == {"a": {"policy-v2", "policy-v3"}, "b": {"policy-v2", "policy-v3"}}
    assert not any(call.startswith(("/pause", "/resume")) for calls in fake.calls.values()
                   for call in calls)
    assert sorted(os.listdir(tmp_path)) == ["policy-v2", "policy-v3"]
    written = tmp_path / "policy-v3"
    assert fake.bodies[("a", "/v1/load_lora_adapter")] == {
        "lora_name": "policy-v3", "lora_path": str(written.resolve()), "load_inplace": True}
    config = json.loads((written / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["peft_type"] == "LORA"
    assert await version(redis) == 3


async def test_a_peft_directory_is_loaded_where_it_is(redis: aioredis.Redis,
                                                      tmp_path: Path) -> None:
    from rollq.consumers.trainer.lora import write_adapter

    write_adapter(adapter(0), tmp_path / "mine")
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1") as tc:
        await tc.publish_policy(4, tmp_path / "mine")
        with pytest.raises(TypeError, match="LoraAdapter needs lora_dir"):
            await tc.publish_policy(5, adapter(5))
        with pytest.raises(TypeError, match=r"has no adapter_config\.json"):
            await tc.publish_policy(5, tmp_path)
    assert fake.bodies[("a", "/v1/load_lora_adapter")]["lora_path"] == str(  # type: ignore[index]
        (tmp_path / "mine").resolve())
    assert await version(redis) == 4


async def test_a_refusing_server_is_named_and_the_version_is_left(redis: aioredis.Redis,
                                                                  tmp_path: Path) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1", "http://b:1", "http://c:1",
                       lora_dir=str(tmp_path)) as tc:
        await tc.publish_policy(1, adapter(1))
        fake.fail = {("b", "/v1/load_lora_adapter"): 400, ("c", "/v1/load_lora_adapter"): 0}
        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(2, adapter(2))
    assert set(raised.value.failures) == {"http://b:1", "http://c:1"}
    assert raised.value.failures["http://b:1"].startswith("load_lora_adapter: HTTP 400")
    assert "ConnectError" in raised.value.failures["http://c:1"]
    assert fake.adapters["a"] == {"policy-v1"}  # v2 unloaded again from the one that took it
    assert await version(redis) == 1


def test_adapter_names_carry_the_version() -> None:
    assert adapter_version("policy", "policy-v12") == 12
    assert adapter_version("policy", "policy-v") is None
    assert adapter_version("policy", "other-v3") is None
    assert adapter_version("a.b", "axb-v3") is None
