"""TRL's AsyncGRPOTrainer on rollq's adapter (``rollq.integrations.trl``), against a real
redis-server and TRL itself: the trainer trains from scored groups, acks a group only after
the step that trained its last sequence, counts what it drops as stale, dead-letters what
it cannot take, keeps one version with rollq and says why the bus stalled. The weight sync
is ``external`` against a recording fake of vLLM's routes (the real ``rollq_tcp`` transfer
runs in tests/integration/test_trl_vllm.py)."""

from __future__ import annotations

import asyncio
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key, stream_key
from tests.factories import make_group, score
from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, FakeVllm, counter, publish_scored

torch = pytest.importorskip("torch", reason="needs the trl extra")
pytest.importorskip("trl", reason="needs the trl extra")

from rollq.consumers.trainer import TrainerClientSettings  # noqa: E402
from rollq.integrations.trl import (  # noqa: E402
    RollqRolloutWorker,
    RollqWeightTransfer,
    flash_attn_varlen_torch,
    use_cpu_kernels,
)

VOCAB = 700  # below the tiny model's 768
pytestmark = [
    pytest.mark.slow,  # each test builds TRL's trainer (10-30 s)
    # TRL 1.16's config sets transformers 5's deprecated `gradient_checkpointing`
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
]


def trainer_for(model: Path, out: Path, worker: RollqRolloutWorker, *, steps: int,
                **config: Any) -> Any:
    import warnings

    from datasets import Dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    use_cpu_kernels()
    args = AsyncGRPOConfig(**{
        "output_dir": str(out), "max_steps": steps, "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 16, "token_budget": 0,
        "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "use_cpu": True, "dtype": "float32",
        "vllm_server_base_url": "http://vllm.test:8000", **config})
    trainer = AsyncGRPOTrainer(
        model=str(model), args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}),
        rollout_worker=worker, weight_transfer=RollqWeightTransfer(worker))
    worker.attach(trainer)
    return trainer


def publish(url: str, groups: list[Any]) -> None:
    async def go() -> None:
        redis = aioredis.Redis.from_url(url)
        for group in groups:
            await publish_scored(redis, group)
        await redis.aclose()
    asyncio.run(go())


def read(url: str, what: Any) -> Any:
    async def go() -> Any:
        redis = aioredis.Redis.from_url(url)
        try:
            return await what(redis)
        finally:
            await redis.aclose()
    return asyncio.run(go())


@pytest.fixture
def fresh(redis_server: RedisServer) -> str:
    read(redis_server.url, lambda r: r.flushall())
    return redis_server.url


def worker_for(url: str, fake: FakeVllm, **settings: Any) -> RollqRolloutWorker:
    return RollqRolloutWorker(url, run=RUN, transport=fake.transport(), poll_s=0.2,
                              settings=TrainerClientSettings(
                                  weight_sync="external", block_ms=50, **settings))


def test_trl_trains_from_rollq_and_acks_after_each_step(fresh: str, tiny_model: Path,
                                                        tmp_path: Path) -> None:
    # 4 steps of one group each, and a fifth: TRL's data loader lays out one micro-batch
    # ahead, which stays pending (trained by the next run, never acked unseen)
    groups = [score(make_group(group_id=f"g{i}", seed=i, vocab=VOCAB)) for i in range(5)]
    too_long = score(make_group(group_id="long", tokens=40, vocab=VOCAB))
    bad_ids = score(make_group(group_id="ids", seed=9, vocab=50_000))
    publish(fresh, [groups[0], too_long, bad_ids, *groups[1:]])
    fake = FakeVllm()
    worker = worker_for(fresh, fake)
    trainer = trainer_for(tiny_model, tmp_path, worker, steps=4)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    assert worker.counts == {"trained": 4, "sequence_too_long": 1}
    assert read(fresh, lambda r: counter(r, "consumed")) == 4
    pending = read(fresh, lambda r: r.xpending(stream_key(RUN, 0, "scored"), "trainer"))
    assert pending["pending"] == 1
    assert read(fresh, lambda r: counter(r, "drop:sequence_too_long")) == 1
    assert read(fresh, lambda r: counter(r, "drop:decode_error")) == 1  # ids >= vocab
    changed = [n for n, p in trainer.model.named_parameters()
               if not torch.equal(p.detach(), before[n])]
    assert changed, "TRL's optimizer stepped on rollq's samples"
    # one sync at train begin, one per step: rollq's version is TRL's
    assert trainer.model_version == 5
    version = read(fresh, lambda r: r.hget(state_key(RUN), POLICY_VERSION_FIELD))
    assert int(version) == 5
    assert fake.calls["vllm.test"].count("/pause?mode=keep") == 5


def test_a_group_is_acked_only_after_the_step_that_trained_its_last_sequence(
        fresh: str, tiny_model: Path, tmp_path: Path) -> None:
    # 6 sequences a group, 4 a step: group 0 ends in step 2, group 1 in step 3 (group 2
    # feeds the micro-batch laid out ahead)
    publish(fresh, [score(make_group(group_id=f"g{i}", seed=i, vocab=VOCAB, group_size=6))
                    for i in range(3)])
    worker = worker_for(fresh, FakeVllm())
    trainer = trainer_for(tiny_model, tmp_path, worker, steps=3, num_generations=6)
    consumed: list[int] = []
    stepped = worker.stepped

    def recording(microbatches: int) -> None:
        stepped(microbatches)
        consumed.append(read(fresh, lambda r: counter(r, "consumed")))
    worker.stepped = recording  # type: ignore[method-assign]
    trainer.train()
    assert consumed == [0, 1, 2]


def test_what_trl_would_drop_as_stale_is_acked_and_counted(
        fresh: str, tiny_model: Path, tmp_path: Path) -> None:
    worker = worker_for(fresh, FakeVllm())
    trainer_for(tiny_model, tmp_path, worker, steps=1, max_staleness=1)
    publish(fresh, [score(make_group(group_id="old", vocab=VOCAB))])
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while worker.rollout_buffer.qsize() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.update_model_version(2)  # two syncs later: too old for TRL's filter
        with pytest.raises(queue.Empty):  # TRL's get never sees it
            worker.rollout_buffer.get(timeout=1)
    finally:
        worker.stop()
    assert worker.counts == {"stale_dropped": 1}
    assert read(fresh, lambda r: counter(r, "drop:stale")) == 1
    assert read(fresh, lambda r: counter(r, "consumed")) == 0
    pending = read(fresh, lambda r: r.xpending(stream_key(RUN, 0, "scored"), "trainer"))
    assert pending["pending"] == 0


def test_check_health_names_the_reason_the_bus_stalled(fresh: str, tiny_model: Path,
                                                       tmp_path: Path) -> None:
    worker = worker_for(fresh, FakeVllm())
    trainer_for(tiny_model, tmp_path, worker, steps=1)
    worker.start()
    try:
        worker.check_health(60)  # just started: healthy
        with pytest.raises(RuntimeError, match=r"nothing generated for run 'test'.*feeder"):
            worker.check_health(0)
    finally:
        worker.stop()


def test_tree_attention_in_torch_matches_plain_causal_attention() -> None:
    """Two samples sharing a prefix, packed as TRL's TreeRow packs them: every position
    attends to exactly its own sample's causal past (the FA3 kernel's result)."""
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for ids in ([1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]):
        row.add({"input_ids": np.array(ids), "completion_mask": np.ones(len(ids), int),
                 "old_log_probs": np.zeros(len(ids)), "advantage": 1.0, "group_id": 0})
    packed = row.pack()
    # a node is keyed on its token and the next: the trie forks one token early
    assert packed["input_ids"].tolist() == [1, 2, 3, 4, 5, 3, 6, 7, 8]
    paths = {"a": [0, 1, 2, 3, 4], "b": [0, 1, 5, 6, 7, 8]}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 4, 8, generator=gen) for _ in range(3))  # [N, heads, dim]
    k, v = k[:, :2], v[:, :2]  # grouped-query attention: 2 K/V heads for 4 query heads
    index = packed["tree_kv_index"]  # as TRL's tree_attention calls the kernel
    out = flash_attn_varlen_torch(q, k[index], v[index], packed["tree_cu_seqlens_q"],
                                  packed["tree_cu_seqlens_k"], 0, 0)
    for path in paths.values():
        want = torch.nn.functional.scaled_dot_product_attention(
            q[path].transpose(0, 1), k[path].transpose(0, 1), v[path].transpose(0, 1),
            is_causal=True, enable_gqa=True)
        assert torch.allclose(out[path], want.transpose(0, 1), atol=1e-5)
