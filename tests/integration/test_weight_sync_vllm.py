"""Weight sync through vLLM's weight-transfer API, on real CPU vLLM servers.

The servers run rollq's CPU backend (``--weight-transfer-config '{"backend": "rollq_tcp"}'``,
the plugin in ops/vllm_plugin). What is checked is what a trainer relies on: after a sync,
vLLM's logprobs for fixed prompts equal the trainer model's own (float32 on both sides:
measured ~5e-7, tolerance 1e-4), the servers and the run report the new version, and every
failure names the server, resumes the others and leaves the run's version unchanged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings, WeightSyncError
from rollq.ops.local.stack import VllmProcess
from rollq.producers.inference.params import SamplingParams
from rollq.producers.inference.server import InferenceServer
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key
from tests.redis_server import RedisServer

torch = pytest.importorskip("torch", reason="needs the train extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["hello world 1 2 3", "the quick brown fox", "7 + 5 = 12 and 3 + 4 ="]
TOLERANCE = 1e-4  # logprob difference, float32 trainer and server


def perturbed(model_dir: Path, seed: int) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def largest_gap(url: str, model: Any) -> float:
    from bench.weight_sync import largest_gap as gap  # imports torch: after the skip

    return gap(url, model, PROMPTS, name="rollq-tiny")


def is_paused(url: str) -> bool:
    return bool(httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"])


def weight_version(url: str) -> str | None:
    return httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]


async def run_version(redis: aioredis.Redis, run: str) -> int:
    return int(await redis.hget(state_key(run), POLICY_VERSION_FIELD) or -1)


def client(redis: aioredis.Redis, run: str, *urls: str, **settings: Any) -> TrainerClient:
    given: dict[str, Any] = {"weight_sync": "transfer", "transfer_backend": "rollq_tcp",
                             "http_timeout_s": 60.0, "new_run": True, **settings}
    return TrainerClient(redis, run=run, consumer="trainer",
                         settings=TrainerClientSettings(inference_urls=urls, **given))


@pytest.fixture
async def redis(redis_server: RedisServer) -> Any:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def served(vllm_server: VllmProcess, tiny_model: Path) -> Iterator[VllmProcess]:
    """The session's server; its starting weights are reloaded afterwards for other tests."""
    yield vllm_server
    httpx.post(f"{vllm_server.url}/collective_rpc", timeout=120, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(tiny_model)}})
    httpx.post(f"{vllm_server.url}/resume", timeout=30)


@pytest.fixture(scope="module")
def second_server(vllm_server: VllmProcess, tiny_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    server = VllmProcess(vllm_server.python, tiny_model,
                         tmp_path_factory.mktemp("vllm-b") / "server.log",
                         compile_cache=vllm_server.compile_cache,
                         weight_transfer="rollq_tcp", extra_args=["--enable-scale-out"])
    yield server.start()
    server.stop()


async def test_transfer_serves_the_trainers_weights_and_reload_still_works(
    served: VllmProcess, redis: aioredis.Redis, tiny_model: Path, tmp_path: Path,
) -> None:
    url = served.url
    first, second = perturbed(tiny_model, 1), perturbed(tiny_model, 2)
    assert largest_gap(url, first) > 0.01  # the server does not serve these weights yet
    async with client(redis, "transfer", url, transfer_chunk_bytes=256 * 1024) as tc:
        assert await tc.publish_policy(1, first) == 1
        assert largest_gap(url, first) < TOLERANCE
        assert await tc.publish_policy(2, second) == 2
        assert largest_gap(url, second) < TOLERANCE
        parameter_bytes = sum(p.numel() * 4 for p in second.parameters())
        assert tc.stats.sync_bytes["transfer"] == 2 * parameter_bytes
        assert tc.stats.sync_seconds["transfer"].count == 2
        assert tc._publisher.reinits == 1  # set up once, reused by the second sync
    assert weight_version(url) == "2" and not is_paused(url)
    assert await run_version(redis, "transfer") == 2

    second.save_pretrained(tmp_path / "w", safe_serialization=True)
    third = perturbed(tiny_model, 3)
    third.save_pretrained(tmp_path / "w3", safe_serialization=True)
    async with client(redis, "transfer", url, weight_sync="reload") as tc:
        await tc.publish_policy(3, tmp_path / "w3")  # a server with transfer still reloads
    assert largest_gap(url, third) < TOLERANCE


async def test_external_pauses_around_the_trainers_own_move(
    served: VllmProcess, redis: aioredis.Redis, tiny_model: Path, tmp_path: Path,
) -> None:
    url = served.url
    model = perturbed(tiny_model, 4)
    model.save_pretrained(tmp_path / "own", safe_serialization=True)
    seen: list[bool] = []

    def move() -> None:  # the trainer's own mechanism: here a reload it asks for itself
        seen.append(is_paused(url))
        httpx.post(f"{url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "own")}}
        ).raise_for_status()

    def broken() -> None:
        seen.append(is_paused(url))
        raise RuntimeError("the trainer's broadcast failed")

    async with client(redis, "external", url, weight_sync="external") as tc:
        assert await tc.publish_policy(5, move) == 5
        assert seen == [True] and not is_paused(url)
        assert largest_gap(url, model) < TOLERANCE and weight_version(url) == "5"
        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(6, broken)
    assert raised.value.failures == {"trainer": "RuntimeError: the trainer's broadcast failed"}
    assert seen == [True, True] and not is_paused(url)  # resumed after the failure
    assert await run_version(redis, "external") == 5 and weight_version(url) == "5"


async def test_a_server_added_then_killed_mid_update_then_restarted(
    served: VllmProcess, second_server: VllmProcess, redis: aioredis.Redis, tiny_model: Path,
) -> None:
    a, b = served.url, second_server.url
    async with client(redis, "faults", a, transfer_chunk_bytes=128 * 1024) as tc:
        model = perturbed(tiny_model, 5)
        await tc.publish_policy(1, model)
        tc.set_inference_urls([a, b])  # a server added between syncs: set up again for both
        model = perturbed(tiny_model, 6)
        await tc.publish_policy(2, model)
        assert tc._publisher.reinits == 2
        assert largest_gap(a, model) < TOLERANCE and largest_gap(b, model) < TOLERANCE

        def killing_b(weights: Any) -> Iterator[tuple[str, Any]]:
            for index, pair in enumerate(weights.named_parameters()):
                if index == 6:  # a few chunks in: b is killed in the middle of the update
                    second_server.kill()
                yield pair

        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(3, killing_b(perturbed(tiny_model, 7)))
        assert list(raised.value.failures) == [b], raised.value.failures
        assert not is_paused(a) and weight_version(a) == "2"
        assert await run_version(redis, "faults") == 2  # nothing moved in the run's books
        # a staged part of step 3, then dropped it: it serves step 2's weights, whole
        assert largest_gap(a, model) < TOLERANCE

        second_server.start()  # b restarts; the next sync sets the transfer up again
        model = perturbed(tiny_model, 8)
        await tc.publish_policy(4, model)
        assert tc._publisher.reinits == 3
        assert largest_gap(a, model) < TOLERANCE and largest_gap(b, model) < TOLERANCE
    assert await run_version(redis, "faults") == 4


def teacher_forced(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
    chosen = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return [float(v) for v in chosen[len(prompt_ids) - 1:]]


async def test_a_sync_that_meets_a_generation_midway_labels_each_token_with_its_weights(
    second_server: VllmProcess, redis: aioredis.Redis, tiny_model: Path,
) -> None:
    """Pause mode ``keep``: a request in flight when the sync pauses the server finishes
    under the new weights. The server (``--enable-scale-out``, so completions go token-in)
    says which tokens which weights sampled; the completion carries exactly that."""
    url = second_server.url
    old, new = perturbed(tiny_model, 11), perturbed(tiny_model, 12)
    params = SamplingParams(max_tokens=440, extra={"ignore_eos": True})
    async with client(redis, "midway", url, pause_mode="keep") as tc, \
            httpx.AsyncClient(timeout=120) as http:
        await tc.publish_policy(10, old)
        server = InferenceServer(url, http)
        for attempt, head_start in enumerate((0.3, 0.1, 0.02, 0.005, 0.0)):
            generation = asyncio.create_task(server.complete([5, 6, 7], 2, params,
                                                             model="rollq-tiny"))
            await asyncio.sleep(head_start)
            await tc.publish_policy(11 + attempt, new if attempt % 2 == 0 else old)
            samples = await generation
            if all(len(s.weight_versions or ()) == 2 for s in samples):
                break  # the sync landed mid-generation, as wanted
        else:
            pytest.fail(f"no sync met the generation midway: {samples[0].weight_versions}")
        # keep: the sync that met the generation midway aborted nothing (issue 44)
        assert tc.last_sync is not None and tc.last_sync.aborted_requests == 0
    assert server.generate_api is True
    synced = 11 + attempt
    sampler_old, sampler_new = (old, new) if attempt % 2 == 0 else (new, old)
    for sample in samples:
        first, second = sample.weight_versions or ()
        assert (first.version, second.version) == (str(synced - 1 if attempt else 10),
                                                   str(synced))
        assert 0 < second.start < len(sample.completion_ids) == second.end
        completion = sample.to_completion(policy_version=0)
        assert completion.policy_version == int(first.version)
        assert completion.token_versions is not None
        assert list(completion.token_versions) == (
            [int(first.version)] * second.start
            + [synced] * (len(sample.completion_ids) - second.start))
        # the labels are the truth: before the switch the old weights sampled every token
        # (logprobs equal theirs); after it the new weights did (the KV cache of the earlier
        # positions is the old weights', so closer to the new model, not equal to it)
        before = slice(0, second.start)
        after = slice(second.start, None)
        old_lp = teacher_forced(sampler_old, sample.prompt_ids, sample.completion_ids)
        new_lp = teacher_forced(sampler_new, sample.prompt_ids, sample.completion_ids)
        assert max(abs(a - b) for a, b in zip(sample.logprobs[before], old_lp[before],
                                              strict=True)) < TOLERANCE * 10
        served = sample.logprobs[after]
        gap_new = sum(abs(a - b) for a, b in zip(served, new_lp[after], strict=True))
        gap_old = sum(abs(a - b) for a, b in zip(served, old_lp[after], strict=True))
        assert gap_new < gap_old / 2, (gap_new, gap_old)


async def test_completions_fall_back_where_the_server_has_no_token_in_api(
    served: VllmProcess,
) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        server = InferenceServer(served.url, http)
        [sample] = await server.complete("hi", 1, SamplingParams(max_tokens=4),
                                         model="rollq-tiny")
    assert server.generate_api is False and sample.weight_versions is None
    assert len(sample.completion_ids) == 4


TRAINER = """
import asyncio, sys, time
import redis.asyncio as aioredis
from pathlib import Path
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from tests.integration.test_weight_sync_vllm import perturbed

async def main():
    model = perturbed(Path(sys.argv[2]), 10)
    def slow():
        for index, pair in enumerate(model.named_parameters()):
            if index == 6:
                print("mid-update", flush=True)
                time.sleep(600)  # killed here
            yield pair
    settings = TrainerClientSettings(inference_urls=(sys.argv[3],), weight_sync="transfer",
                                     transfer_backend="rollq_tcp", transfer_chunk_bytes=65536,
                                     new_run=True)
    redis = aioredis.Redis.from_url(sys.argv[1])
    async with TrainerClient(redis, run="killed", consumer="t", settings=settings) as tc:
        await tc.publish_policy(1, model)
        await tc.publish_policy(2, slow())

asyncio.run(main())
"""


def test_a_trainer_killed_mid_update_leaves_the_server_serving_its_last_weights(
    served: VllmProcess, redis_server: RedisServer, tiny_model: Path,
) -> None:
    url = served.url
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, redis_server.url,
                                str(tiny_model), url], stdout=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:
        assert trainer.stdout is not None
        for line in trainer.stdout:  # its log lines, then the marker
            if line.strip() == b"mid-update":
                break
        else:
            pytest.fail(f"the trainer exited with {trainer.wait()} before the update")
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
    # Step 2 was being staged, so the server never paused: it serves step 1, whole, while
    # vLLM still holds the dead update open. The restarted trainer's first sync drops it.
    assert not is_paused(url) and weight_version(url) == "1"
    assert largest_gap(url, perturbed(tiny_model, 10)) < TOLERANCE
    model = perturbed(tiny_model, 9)

    async def restarted_trainer() -> None:
        redis = aioredis.Redis.from_url(redis_server.url)
        async with client(redis, "killed", url) as tc:
            await tc.publish_policy(2, model)
        await redis.aclose()

    asyncio.run(restarted_trainer())
    assert not is_paused(url) and weight_version(url) == "2"
    assert largest_gap(url, model) < TOLERANCE


def test_the_plugin_registers_both_engines_through_vllms_entry_point(
    vllm_server: VllmProcess,
) -> None:
    probe = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
             "from vllm.distributed.weight_transfer.factory import "
             "WeightTransferEngineFactory as W, WeightTransferTrainerFactory as T; "
             "print(W._registry['rollq_tcp']().__name__, 'rollq_tcp' in T._registry)")
    found = subprocess.run([vllm_server.python, "-c", probe], capture_output=True, text=True,
                           timeout=300, check=True)
    assert found.stdout.split()[-2:] == ["TcpWeightTransferEngine", "True"]
