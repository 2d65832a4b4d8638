"""The example trainer stops cleanly on SIGINT/SIGTERM (issue 32, item 8): one line, exit
130 or 0, a checkpoint when a step was done since the last one, no false Redis outage, no
"Task was destroyed", no per-step tensor warning; it logs while it waits for data. A real
subprocess of examples/grpo_trainer.py on a tiny model and a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.factories import make_group
from tests.redis_server import RedisServer
from tests.trainer.helpers import RUN, publish_scored

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "grpo_trainer.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollq.ops.local.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model"))


async def start(redis_url: str, model: Path, out: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(TRAINER), "--redis-url", redis_url, "--run", RUN,
        "--model", str(model), "--out", str(out), "--steps", "50", "--batch-groups", "1",
        "--checkpoint-every", "1000", "--wait-log-s", "0.5", "--torch-threads", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})  # this tree's packages


async def read_until(stream: asyncio.StreamReader, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        line = await asyncio.wait_for(stream.readline(), 120)
        assert line, f"the trainer ended before {marker!r}: {seen.decode()[-2000:]}"
        seen += line
    return seen


@pytest.mark.slow  # the trainer's process, with torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
async def test_a_stop_while_waiting_for_data_saves_the_steps_done_and_says_one_line(
        sig: signal.Signals, code: int, real_redis: aioredis.Redis, redis_server: RedisServer,
        tiny_model: Path, tmp_path: Path) -> None:
    for seed in range(2):
        await publish_scored(real_redis, make_group(run=RUN, seed=seed, vocab=700))
    process = await start(redis_server.url, tiny_model, tmp_path / "out")
    assert process.stdout is not None and process.stderr is not None
    before = await read_until(process.stdout, b"step 2 ")
    before += await read_until(process.stdout, b"trainer_waiting")  # it says it waits
    process.send_signal(sig)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    output = (before + out).decode() + err.decode()
    assert process.returncode == code, output[-3000:]
    lines = [line for line in err.decode().splitlines() if "grpo_trainer" in line]
    assert lines == [(f"grpo_trainer: stopped by {sig.name} after step 2; checkpoint "
                         f"saved to {tmp_path / 'out' / 'checkpoint.pt'} (continue with "
                         "--resume)")]
    for bad in ("Traceback", "redis_outage_started", "Task was destroyed",
                "requires_grad"):
        assert bad not in output, output[-3000:]
    import torch

    saved = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 2


@pytest.mark.slow  # the trainer's process, with torch
@pytest.mark.timeout(300)
async def test_a_stop_before_any_data_is_one_line_and_nothing_saved(
        real_redis: aioredis.Redis, redis_server: RedisServer, tiny_model: Path,
        tmp_path: Path) -> None:
    process = await start(redis_server.url, tiny_model, tmp_path / "out")
    assert process.stdout is not None
    await read_until(process.stdout, b"trainer_waiting")
    process.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 130, (out + err).decode()[-3000:]
    assert [line for line in err.decode().splitlines() if "grpo_trainer" in line] == [
        "grpo_trainer: stopped by SIGINT after step 0; nothing new to save"]
    assert "Traceback" not in err.decode()
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_the_learning_rate_warms_up_linearly_then_stays() -> None:
    sys.path.insert(0, str(TRAINER.parent))
    try:
        import grpo_trainer
        import torchrun_trainer  # its ranks take the same ramp
    finally:
        sys.path.remove(str(TRAINER.parent))
    common = ["--model", "m", "--out", "o", "--lr", "1e-3"]
    for trainer in (grpo_trainer, torchrun_trainer):
        ramp = trainer.parse_args([*common, "--warmup-steps", "10"])
        assert [grpo_trainer.learning_rate(ramp, s) for s in (1, 5, 10, 11, 300)] == (
            pytest.approx([1e-4, 5e-4, 1e-3, 1e-3, 1e-3]))
        flat = trainer.parse_args(common)
        assert grpo_trainer.learning_rate(flat, 1) == 1e-3


def test_a_batch_the_correction_cannot_use_is_refused_before_any_step(tiny_model: Path) -> None:
    """``--is-correction`` on groups sampled with processed logprobs at top_p 0.9: their
    ratio would read the kept mass, not 1 (issue 44); the step refuses the batch, naming
    why, before the model moves (the trainer exits 78, the batch stays pending)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    from rollq.consumers.trainer.batch import BatchData
    from rollq.consumers.trainer.layout import PaddedArrays, pad_groups
    from rollq.schemas import Completion, ConfigError, TrajectoryGroup
    from rollq.schemas.models import SamplingRecord
    from tests.factories import score

    spec = importlib.util.spec_from_file_location("grpo_trainer_refusal", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = trainer
    spec.loader.exec_module(trainer)
    record = SamplingRecord(temperature=1.0, top_p=0.9, top_k=-1, min_p=0.0,
                            logprobs_mode="processed_logprobs", model="rollq-tiny")
    group = make_group(run=RUN, vocab=700)
    group = TrajectoryGroup(**{**group.model_dump(), "completions": tuple(
        Completion(**{**c.model_dump(), "sampling": record}) for c in group.completions)})
    padded = pad_groups([score(group)])
    batch = BatchData(**{name: getattr(padded, name) for name in PaddedArrays.__dataclass_fields__},
                      sources=(score(group),), entries=())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    refuse = trainer.parse_args(["--model", str(tiny_model), "--out", "unused",
                                 "--is-correction", "tis"])
    with pytest.raises(ConfigError, match=r"tis cannot use this batch: .*top_p=0\.9"):
        trainer.train_on(batch, 1, model, None, optimizer, refuse)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # without a correction there is nothing to refuse: the step runs
    trainer.train_on(batch, 1, model, None, optimizer, trainer.parse_args([
        "--model", str(tiny_model), "--out", "unused", "--is-correction", "none"]))
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.slow  # the module's tiny model is written by the first test that asks for it
def test_logprobs_over_the_mask_alone_equal_the_full_forwards_with_their_gradients(
        tiny_model: Path) -> None:
    """``token_logprobs(..., mask)`` runs the output layer on the masked positions only; the
    values there and the loss's gradients are the full forward's."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("grpo_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 700, (3, 12), generator=generator)
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0  # a padded row
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.zeros(3, 12)
    mask[0, 4:11], mask[1, 6:9], mask[2, 3:8] = 1, 1, 1
    advantages = torch.randn(3, 12, generator=generator)
    found = []
    for given in (None, mask):
        model.zero_grad()
        logprobs = trainer.token_logprobs(model, ids, attention, labels, given)
        loss, _ = trainer.grpo_loss(logprobs, logprobs.detach(), advantages, mask, 0.2)
        loss.backward()
        found.append((logprobs.detach() * mask, [p.grad.clone() for p in model.parameters()]))
    (full, full_grads), (masked, masked_grads) = found
    assert torch.allclose(full, masked, atol=1e-5) and bool((masked[mask == 0] == 0).all())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full_grads, masked_grads,
                                                                strict=True))


@pytest.mark.slow  # as above
def test_frozen_embeddings_and_lower_blocks_do_not_train(tiny_model: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("grpo_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    args = trainer.parse_args(["--model", "m", "--out", "o", "--freeze-embeddings",
                               "--train-layers", "1"])
    names = {id(p): n for n, p in model.named_parameters()}
    trained = {names[id(p)] for p in trainer.trainable(model, args)}
    assert trained and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trained)
    assert "model.layers.1.mlp.down_proj.weight" in trained
