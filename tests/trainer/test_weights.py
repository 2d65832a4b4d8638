"""publish_policy: the per-server call sequence, failure reporting, monotonic version."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings, WeightSyncError
from rollq.schemas import BrokerUnavailable
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key
from tests.trainer.helpers import RUN, FakeVllm

SEQUENCE = ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache",
            "/update_weight_version", "/resume"]


def trainer(redis: aioredis.Redis, fake: FakeVllm, *urls: str, **settings: object) -> TrainerClient:
    return TrainerClient(
        redis, run=RUN, consumer="rank0", transport=fake.transport(),
        settings=TrainerClientSettings(inference_urls=urls, new_run=True,
                                       **settings),  # type: ignore[arg-type]
    )


async def version(redis: aioredis.Redis) -> int:
    return int(await redis.hget(state_key(RUN), POLICY_VERSION_FIELD) or -1)


async def test_publish_runs_the_sequence_on_every_server(redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:8000", "http://b:8000/") as tc:
        assert await tc.publish_policy(3, "/ckpt/step-3") == 3
    assert fake.calls == {"a": SEQUENCE, "b": SEQUENCE}
    assert fake.bodies[("a", "/collective_rpc")] == {
        "method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-3"}}
    assert fake.bodies[("b", "/update_weight_version")] == {"new_version": "3"}
    assert await version(redis) == 3


async def test_pause_mode_is_configurable(redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:8000", pause_mode="wait") as tc:
        await tc.publish_policy(1, "/w")
    assert fake.calls["a"][0] == "/pause?mode=wait"


async def test_a_failing_server_is_reported_resumed_and_blocks_the_version_bump(
    redis: aioredis.Redis,
) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1", "http://b:1", "http://c:1") as tc:
        await tc.publish_policy(1, "/w1")
        fake.fail = {("b", "/collective_rpc"): 500, ("c", "/pause"): 0}
        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(2, "/w2")
    error = raised.value
    assert error.step == 2 and set(error.failures) == {"http://b:1", "http://c:1"}
    assert error.failures["http://b:1"].startswith("reload_weights: HTTP 500")
    assert "/collective_rpc broke" in error.failures["http://b:1"]
    assert error.failures["http://c:1"].startswith("pause: cannot connect")
    assert fake.calls["a"] == SEQUENCE * 2
    # b was paused, so it is resumed even though its reload failed; c was never reached.
    assert fake.calls["b"][-3:] == ["/pause?mode=keep", "/collective_rpc", "/resume"]
    assert fake.calls["c"][-1] == "/pause?mode=keep"
    assert await version(redis) == 1  # not bumped: some servers still serve step 1


async def test_a_failed_resume_is_reported(redis: aioredis.Redis) -> None:
    fake = FakeVllm(fail={("a", "/resume"): 503})
    async with trainer(redis, fake, "http://a:1") as tc:
        with pytest.raises(WeightSyncError, match="resume: HTTP 503"):
            await tc.publish_policy(1, "/w")


async def test_success_false_is_a_failure(redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    original = fake.handle

    def handle(request):  # type: ignore[no-untyped-def]
        if request.url.path == "/reset_prefix_cache":
            fake.calls[request.url.host].append(request.url.path)
            import httpx

            return httpx.Response(200, json={"success": False})
        return original(request)

    fake.handle = handle  # type: ignore[method-assign]
    async with trainer(redis, fake, "http://a:1") as tc:
        with pytest.raises(WeightSyncError, match="reset_prefix_cache: server answered"):
            await tc.publish_policy(1, "/w")
    assert fake.calls["a"][-1] == "/resume"


async def test_policy_version_never_goes_down(redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    await redis.hset(state_key(RUN), POLICY_VERSION_FIELD, "7")
    async with trainer(redis, fake, "http://a:1") as tc:
        assert await tc.publish_policy(5, "/w5") == 7  # e.g. after resuming an older checkpoint
        assert await version(redis) == 7
        assert await tc.current_version() == 5  # staleness follows the trainer's own step
        assert await tc.publish_policy(9, "/w9") == 9
    assert await version(redis) == 9
    with pytest.raises(ValueError):
        async with trainer(redis, fake) as tc:
            await tc.publish_policy(-1, "/w")


# -- external and transfer: the servers as one unit ------------------------------------------

EXTERNAL = ["/pause?mode=keep", "/reset_prefix_cache", "/update_weight_version", "/resume"]


async def test_external_pauses_every_server_around_the_move_and_bumps_before_resuming(
    redis: aioredis.Redis,
) -> None:
    fake = FakeVllm()
    seen: list[tuple[dict[str, list[str]], int]] = []
    order: list[str] = []

    async def move() -> None:  # the trainer's own broadcast, while every server is paused
        seen.append(({host: list(calls) for host, calls in fake.calls.items()},
                     await version(redis)))

    original = fake.handle

    def handle(request):  # type: ignore[no-untyped-def]
        if request.url.path != "/metrics":  # read around the sync, not a step of it
            order.append(request.url.path)
        return original(request)

    fake.handle = handle  # type: ignore[method-assign]
    async with trainer(redis, fake, "http://a:1", "http://b:1", weight_sync="external") as tc:
        raise_version = tc._ledger.raise_policy_version

        async def recorded(step: int) -> int:
            order.append("bump")
            return await raise_version(step)

        tc._ledger.raise_policy_version = recorded  # type: ignore[method-assign]
        assert await tc.publish_policy(4, move) == 4
        assert tc.last_sync is not None and tc.last_sync.method == "external"
        assert tc.stats.sync_seconds["external"].count == 1
    assert seen == [({"a": ["/pause?mode=keep"], "b": ["/pause?mode=keep"]}, -1)]
    assert fake.calls == {"a": EXTERNAL, "b": EXTERNAL}
    assert order[-3:] == ["bump", "/resume", "/resume"]  # no server resumes before the bump
    assert await version(redis) == 4


async def test_a_failed_move_resumes_every_server_and_keeps_the_version(
    redis: aioredis.Redis,
) -> None:
    fake = FakeVllm()

    def move() -> None:
        raise RuntimeError("broadcast timed out")

    async with trainer(redis, fake, "http://a:1", weight_sync="external") as tc:
        await tc.publish_policy(1, None)  # weights already in place: nothing to move
        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(2, move)
    assert raised.value.failures == {"trainer": "RuntimeError: broadcast timed out"}
    assert fake.calls["a"] == [*EXTERNAL, "/pause?mode=keep", "/resume"]
    assert await version(redis) == 1


async def test_a_server_that_cannot_pause_stops_the_sync_before_anything_moves(
    redis: aioredis.Redis,
) -> None:
    fake = FakeVllm(fail={("b", "/pause"): 0})
    moved: list[int] = []
    async with trainer(redis, fake, "http://a:1", "http://b:1", weight_sync="external") as tc:
        with pytest.raises(WeightSyncError) as raised:
            await tc.publish_policy(1, lambda: moved.append(1))
    assert list(raised.value.failures) == ["http://b:1"]
    assert moved == []  # nothing moved while a server still served
    assert fake.calls["a"] == ["/pause?mode=keep", "/resume"]  # the paused one resumed
    assert fake.calls["b"] == ["/pause?mode=keep"]  # unreachable: nothing to resume
    assert await version(redis) == -1


async def test_the_weights_argument_must_match_the_method(redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1") as tc:
        with pytest.raises(TypeError, match="weight_sync='transfer'"):
            await tc.publish_policy(1, object())  # a model given to reload
    async with trainer(redis, fake, "http://a:1", weight_sync="transfer") as tc:
        for wrong in (None, "/ckpt/step-1"):
            with pytest.raises(TypeError, match="weight_sync='reload'"):
                await tc.publish_policy(1, wrong)
    async with trainer(redis, fake, "http://a:1", weight_sync="external") as tc:
        with pytest.raises(TypeError, match="callable"):
            await tc.publish_policy(1, "/ckpt/step-1")
    assert fake.calls["a"] == []  # refused before any server was paused
    with pytest.raises(ValueError, match="weight_sync"):
        TrainerClientSettings(weight_sync="rsync")  # type: ignore[arg-type]


async def test_a_version_bump_that_fails_still_resumes_every_server(
    redis: aioredis.Redis,
) -> None:
    fake = FakeVllm()
    async with trainer(redis, fake, "http://a:1", weight_sync="external",
                       redis_give_up_s=0) as tc:
        async def down(step: int) -> int:
            raise BrokerUnavailable("redis is down")

        tc._ledger.raise_policy_version = down  # type: ignore[method-assign]
        with pytest.raises(BrokerUnavailable):
            await tc.publish_policy(1, None)
    assert fake.calls["a"] == EXTERNAL  # resumed although the bump failed


@pytest.mark.parametrize(("mode", "aborted"), [("keep", 0), ("wait", 0), ("abort", 2)])
async def test_a_sync_reports_the_requests_the_servers_aborted(
        redis: aioredis.Redis, mode: str, aborted: int) -> None:
    fake = FakeVllm(aborted={"a": 5, "b": 0})  # the fake aborts one request per abort pause
    async with trainer(redis, fake, "http://a:8000", "http://b:8000", pause_mode=mode) as tc:
        await tc.publish_policy(1, "/w")
        assert tc.last_sync is not None and tc.last_sync.aborted_requests == aborted
        assert tc.stats.sync_aborts["reload"].count == 1
    assert "/metrics" not in fake.calls["a"]


async def test_a_server_without_metrics_leaves_the_abort_count_unknown(
        redis: aioredis.Redis) -> None:
    fake = FakeVllm(aborted={"a": 0})  # b has no /metrics
    async with trainer(redis, fake, "http://a:8000", "http://b:8000") as tc:
        await tc.publish_policy(1, "/w")
        assert tc.last_sync is not None and tc.last_sync.aborted_requests is None
        assert tc.stats.sync_aborts["reload"].count == 0
