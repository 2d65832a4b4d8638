"""InferencePool behaviour against the fake: retries, balancing, health, pauses."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from rollq.producers.inference import (
    Backoff,
    GenerationAborted,
    InferencePool,
    InferenceRequestError,
    PauseTimeout,
    SamplingParams,
)
from rollq.schemas import ConfigError, ContractError, InferenceUnavailable, TransientError
from tests.producers.fake_vllm import EOS, FakeVLLM, fake_transport, logprob_of

FAST = Backoff(initial_s=0.001, multiplier=2.0, max_s=0.005, jitter=0.5)


def make_pool(*fakes: FakeVLLM, **options: Any) -> InferencePool:
    options.setdefault("backoff", FAST)
    options.setdefault("pause_poll", FAST)
    options.setdefault("health_interval_s", None)
    return InferencePool([fake.base_url for fake in fakes], model="rollq-tiny",
                         transport=fake_transport(*fakes), **options)


async def test_complete_returns_n_choices_with_server_logprobs() -> None:
    fake = FakeVLLM()
    async with make_pool(fake) as pool:
        samples = await pool.complete([1, 200, 201], n=3, params=SamplingParams(seed=1))
    assert len(samples) == 3
    for index, sample in enumerate(samples):
        assert sample.prompt_ids == [1, 200, 201]
        assert sample.completion_ids[-1] == EOS and sample.finish_reason == "stop"
        assert sample.logprobs == [logprob_of(t, index) for t in sample.completion_ids]
    completion = samples[0].to_completion(policy_version=4)
    assert completion.loss_mask.tolist() == [1] * len(samples[0].completion_ids)
    assert completion.policy_version == 4


async def test_sampling_params_are_sent_and_extra_passes_through() -> None:
    fake = FakeVLLM()
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=4, stop=("\n",), seed=3,
                            extra={"min_p": 0.1})
    async with make_pool(fake) as pool:
        [sample] = await pool.complete("hi", params=params)
    body = fake.requests[-1][1]
    assert body["temperature"] == 0.7 and body["top_k"] == 5 and body["max_tokens"] == 4
    assert body["stop"] == ["\n"] and body["seed"] == 3 and body["min_p"] == 0.1
    assert len(sample.completion_ids) <= 4


async def test_model_is_discovered_once_when_not_configured() -> None:
    fake = FakeVLLM(model="served-name")
    async with InferencePool([fake.base_url], transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        await pool.complete("a")
        await pool.complete("b")
        assert (await pool.model_info()).max_model_len == 512
    assert fake.counts["/v1/models"] == 1
    assert fake.requests[-1][1]["model"] == "served-name"


async def test_configured_model_not_served_is_a_config_error() -> None:
    fake = FakeVLLM()
    async with InferencePool([fake.base_url], model="other", transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        with pytest.raises(ConfigError, match="rollq-tiny"):
            await pool.model_info()


@pytest.mark.parametrize("kind", ["connect", "timeout", "500", "503"])
async def test_transient_failures_are_retried_then_succeed(kind: str) -> None:
    fake = FakeVLLM()
    fake.fail_next(kind, count=2)
    async with make_pool(fake, max_retries=2) as pool:
        samples = await pool.complete("hi")
    assert samples and fake.counts["/v1/completions"] == 3


@pytest.mark.parametrize("kind", ["connect", "timeout", "500"])
async def test_exhausted_retries_raise_inference_unavailable(kind: str) -> None:
    fake = FakeVLLM()
    fake.fail_next(kind, count=10)
    async with make_pool(fake, max_retries=3) as pool:
        with pytest.raises(InferenceUnavailable) as caught:
            await pool.complete("hi")
    assert isinstance(caught.value, TransientError)
    assert fake.counts["/v1/completions"] == 4  # first attempt + 3 retries


async def test_4xx_is_not_retried_and_keeps_the_message() -> None:
    fake = FakeVLLM(max_model_len=8)
    async with make_pool(fake, max_retries=3) as pool:
        with pytest.raises(InferenceRequestError, match="maximum context length") as caught:
            await pool.complete(list(range(100, 120)))
    assert isinstance(caught.value, ContractError)
    assert fake.counts["/v1/completions"] == 1


async def test_backoff_grows_exponentially_within_jitter() -> None:
    backoff = Backoff(initial_s=1.0, multiplier=2.0, max_s=5.0, jitter=0.25)
    delays = [backoff.delay(attempt) for attempt in range(5)]
    for delay, base in zip(delays, [1, 2, 4, 5, 5], strict=True):
        assert base * 0.75 <= delay <= base * 1.25


async def test_least_outstanding_sends_more_to_the_fast_server() -> None:
    slow, fast = FakeVLLM("http://slow.test", latency_s=0.2), FakeVLLM("http://fast.test",
                                                                        latency_s=0.01)
    async with make_pool(slow, fast) as pool:

        async def client() -> None:
            for _ in range(8):
                await pool.complete("hi")

        await asyncio.gather(*(client() for _ in range(4)))
    assert fast.counts["/v1/completions"] > 2 * slow.counts["/v1/completions"]
    assert slow.counts["/v1/completions"] >= 1


async def test_ties_go_round_robin() -> None:
    fakes = [FakeVLLM(f"http://s{i}.test") for i in range(3)]
    async with make_pool(*fakes) as pool:
        for _ in range(6):
            await pool.complete("hi")
    assert [fake.counts["/v1/completions"] for fake in fakes] == [2, 2, 2]


async def test_unhealthy_server_is_skipped_until_it_recovers() -> None:
    down, up = FakeVLLM("http://down.test"), FakeVLLM("http://up.test")
    down.down = True
    async with make_pool(down, up, health_interval_s=0.01) as pool:
        assert await pool.health() == {"http://down.test": False, "http://up.test": True}
        for _ in range(5):
            await pool.complete("hi")
        assert down.counts["/v1/completions"] == 0
        down.down = False
        await pool.health()
        for _ in range(4):
            await pool.complete("hi")
    assert down.counts["/v1/completions"] >= 1


async def test_connection_error_marks_server_unhealthy_and_retries_elsewhere() -> None:
    flaky, good = FakeVLLM("http://flaky.test"), FakeVLLM("http://good.test")
    async with make_pool(flaky, good, health_interval_s=60) as pool:
        await pool.health()
        flaky.fail_next("connect", count=1)
        for _ in range(4):
            assert await pool.complete("hi")
        assert not pool.servers[0].healthy  # until the next probe
    assert flaky.counts["/v1/completions"] <= 1
    assert good.counts["/v1/completions"] >= 4


async def test_all_unhealthy_retries_then_raises() -> None:
    fake = FakeVLLM()
    fake.down = True
    async with make_pool(fake, health_interval_s=0.01, max_retries=2) as pool:
        await pool.health()
        with pytest.raises(InferenceUnavailable, match="no healthy inference server"):
            await pool.complete("hi")


async def test_health_task_failure_propagates() -> None:
    fake = FakeVLLM()
    pool = make_pool(fake, health_interval_s=0.001)

    async def broken(server: object) -> None:
        raise RuntimeError("bug in probe")

    pool._probe = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="bug in probe"):
        async with pool:
            await asyncio.sleep(0.01)
            await pool.complete("hi")


async def test_request_while_paused_waits_and_succeeds_after_resume() -> None:
    fake = FakeVLLM()
    async with make_pool(fake, health_interval_s=60) as pool:
        await pool.health()
        fake.pause("keep")
        await pool.health()  # the pool now knows the server is paused
        task = asyncio.create_task(pool.complete("hi"))
        await asyncio.sleep(0.05)
        assert not task.done() and fake.counts["/v1/completions"] == 0
        assert fake.counts["/is_paused"] > 2  # polled while waiting
        fake.resume()
        samples = await asyncio.wait_for(task, 1)
    assert samples and fake.counts["/v1/completions"] == 1


async def test_aborted_generation_is_resent_after_resume() -> None:
    fake = FakeVLLM(latency_s=0.1)
    async with make_pool(fake, max_retries=0) as pool:
        task = asyncio.create_task(pool.complete("hi", n=2))
        await asyncio.sleep(0.02)
        fake.pause("abort")
        await asyncio.sleep(0.05)
        assert not task.done()
        fake.resume()
        samples = await asyncio.wait_for(task, 1)
    assert [s.finish_reason for s in samples] == ["stop", "stop"]
    assert fake.counts["/v1/completions"] == 2


async def test_request_sent_to_a_paused_server_is_held_until_resume() -> None:
    fake = FakeVLLM()
    async with make_pool(fake) as pool:  # no probes: the pool does not know it is paused
        fake.pause("wait")
        task = asyncio.create_task(pool.complete("hi"))
        await asyncio.sleep(0.03)
        assert not task.done()
        fake.resume()
        assert await asyncio.wait_for(task, 1)


async def test_pause_longer_than_the_timeout_raises_pause_timeout() -> None:
    fake = FakeVLLM()
    async with make_pool(fake, health_interval_s=60, pause_timeout_s=0.05) as pool:
        fake.pause()
        await pool.health()
        with pytest.raises(PauseTimeout):
            await pool.complete("hi")


async def test_too_many_aborts_raise_generation_aborted() -> None:
    fake = FakeVLLM(latency_s=0.05)
    async with make_pool(fake, max_aborts=1) as pool:

        async def pauser() -> None:
            for _ in range(2):
                await asyncio.sleep(0.02)
                fake.pause("abort")
                await asyncio.sleep(0.01)
                fake.resume()

        pausing = asyncio.create_task(pauser())
        with pytest.raises(GenerationAborted):
            await pool.complete("hi")
        await pausing


async def test_requests_need_the_context_manager() -> None:
    pool = make_pool(FakeVLLM())
    with pytest.raises(RuntimeError, match="async with"):
        await pool.complete("hi")


async def test_httpx_errors_never_escape() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.UnsupportedProtocol("nope", request=request)

    async with InferencePool(["http://x.test"], model="m", transport=httpx.MockTransport(broken),
                             health_interval_s=None, max_retries=1, backoff=FAST) as pool:
        with pytest.raises(InferenceUnavailable):
            await pool.tokenize(prompt="hi")
