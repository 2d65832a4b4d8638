"""Every endpoint answers as atroposlib 0.4.0's own server does: one scenario of requests
runs against both apps in-process and the answers are compared, endpoint by endpoint."""

from __future__ import annotations

import gzip
import importlib
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from rollq.ops.atropos.app import create_app
from rollq.ops.settings import AtroposApiSettings
from tests.atropos.helpers import (
    REGISTRATION,
    api_client,
    atropos_group,
    env_registration,
    marker_of,
)
from tests.redis_server import RedisServer

server = pytest.importorskip("atroposlib.api.server",
                             reason="atroposlib is not installed (pip install rollq[atropos])")


def _scenario() -> list[tuple[str, str, Any]]:
    """(method, path, JSON body) in order; one batch forms per /batch call."""
    return [
        ("GET", "/", None),
        ("GET", "/info", None),
        ("GET", "/wandb_info", None),
        ("GET", "/batch", None),  # before /register: the error answer
        ("GET", "/status", None),
        ("POST", "/register", REGISTRATION),
        ("POST", "/register-env", env_registration()),  # the trainer has not started
        ("GET", "/info", None),
        ("GET", "/wandb_info", None),
        ("GET", "/batch", None),  # starts the trainer: nothing to hand out yet
        ("POST", "/register-env", env_registration()),
        ("POST", "/register-env", env_registration()),  # same name: gsm8k_1
        ("POST", "/register-env", env_registration("other", 4, min_batch_allocation=None)),
        ("POST", "/scored_data", atropos_group(1)),
        ("GET", "/latest_example", None),
        ("POST", "/scored_data", atropos_group(2, env_id=1)),
        ("POST", "/scored_data", atropos_group(3, size=1)),  # mixed size: buffered
        ("POST", "/scored_data", atropos_group(4, size=1)),  # completes a group of 2
        ("GET", "/status", None),
        ("GET", "/status-env", {"env_id": 0}),
        ("GET", "/status-env", {"env_id": 2}),
        ("GET", "/batch", None),
        ("GET", "/status", None),
        ("POST", "/scored_data_list", [atropos_group(5, size=1, env_id=2),
                                       atropos_group(6, size=4, env_id=2),
                                       atropos_group(7, advantages=[[0.5] * 7, [-0.5] * 8],
                                                     messages=[[{"role": "user",
                                                                 "content": "hi"}]] * 2)]),
        ("GET", "/latest_example", None),
        ("GET", "/status-env", {"env_id": 1}),
        ("GET", "/batch", None),
        ("GET", "/batch", None),
        ("POST", "/disconnect-env", {"env_id": 1}),
        ("POST", "/disconnect-env", {"env_id": 9}),
        ("GET", "/status-env", {"env_id": 0}),
        ("POST", "/scored_data", {"tokens": [[1]], "masks": [[1]], "scores": "x"}),  # 422
        ("GET", "/reset_data", None),
        ("GET", "/status", None),
        ("GET", "/info", None),
    ]


async def _play(client: httpx.AsyncClient) -> list[tuple[int, Any]]:
    answers = []
    for method, path, body in _scenario():
        response = await client.request(method, path, json=body)
        try:
            payload: Any = response.json()
        except ValueError:
            payload = response.text
        if isinstance(payload, dict) and "uuid" in payload:
            assert isinstance(payload["uuid"], int)
            payload["uuid"] = "<uuid>"
        if isinstance(payload, dict) and isinstance(payload.get("detail"), list):
            payload["detail"] = [e["loc"] for e in payload["detail"]]  # messages may differ
        answers.append((response.status_code, payload))
    return answers


async def test_every_endpoint_answers_as_atroposlib(redis: aioredis.Redis) -> None:
    fresh = importlib.reload(server)  # atroposlib keeps its state on a module-level app
    transport = httpx.ASGITransport(app=fresh.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://atroposlib.test") as c:
        theirs = await _play(c)
    async with api_client(redis) as client:
        ours = await _play(client)
    for (method, path, _), mine, reference in zip(_scenario(), ours, theirs, strict=True):
        assert mine == reference, f"{method} {path}"


async def test_gzip_both_ways_and_a_bad_gzip_body(redis: aioredis.Redis) -> None:
    async with api_client(redis) as client:
        await client.post("/register", json=REGISTRATION)
        await client.get("/batch")
        await client.post("/register-env", json=env_registration())
        big = atropos_group(1, completion=600)
        response = await client.post("/scored_data", content=gzip.compress(orjson.dumps(big)),
                                      headers={"Content-Encoding": "gzip",
                                               "Content-Type": "application/json"})
        assert response.json() == {"status": "received"}
        await client.post("/scored_data", json=atropos_group(2, completion=600))
        response = await client.get("/batch", headers={"Accept-Encoding": "gzip"})
        assert response.headers["content-encoding"] == "gzip"
        assert [marker_of(g) for g in response.json()["batch"]] == [1, 2]
        assert response.json()["batch"][0]["tokens"] == big["tokens"]
        bad = await client.post("/scored_data", content=b"not gzip",
                                headers={"Content-Encoding": "gzip"})
        assert (bad.status_code, bad.text) == (400, "Invalid gzip payload")


async def test_groups_come_back_exactly_as_posted(redis: aioredis.Redis) -> None:
    odd = atropos_group(
        1, advantages=[[0.1] * 7, [0.3] * 8],  # not float32-exact: kept verbatim
        ref_logprobs=[[-0.1] * 7, [-0.2] * 8], generation_params={"temperature": 0.7},
        overrides=[{"set_advantage_to_zero": True}, {}], group_overrides={"group_size": 2},
        images=["data:image/png;base64,AAAA"], distill_token_ids=[[[1, 2]] * 7, [[3, 4]] * 8],
        distill_logprobs=[[[-0.5, -1.5]] * 7, [[-0.25, -2.0]] * 8],
        messages=[[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 2)
    odd["scores"] = [0.1, -1e-7]
    odd["masks"][1][5] = 7  # a label that is not the token: masks kept verbatim
    odd["inference_logprobs"][0][0] = 0.0  # not atroposlib's 1.0 filler: kept verbatim
    plain = atropos_group(2)
    async with api_client(redis) as client:
        await client.post("/register", json={**REGISTRATION, "batch_size": 4})
        await client.get("/batch")
        await client.post("/register-env", json=env_registration())
        for group in (odd, plain):
            assert (await client.post("/scored_data", json=group)).status_code == 200
        batch = (await client.get("/batch")).json()["batch"]
    expected = [server.ScoredData.model_validate(g).model_dump() for g in (odd, plain)]
    assert batch == expected


@pytest.mark.parametrize(("body", "message"), [
    ({"tokens": [], "masks": [], "scores": []}, "at least one sequence"),
    ({"tokens": [[1, 2]], "masks": [[1]], "scores": [1.0]}, "masks[0] has 1 values"),
    ({"tokens": [[1]], "masks": [[1]], "scores": [1.0, 2.0]}, "scores has 2 entries"),
    ({"tokens": [[-5]], "masks": [[-5]], "scores": [1.0]}, "outside 0.."),
    ({"tokens": [[2**40]], "masks": [[1]], "scores": [1.0]}, "outside 0.."),
    ({"tokens": [[1]], "masks": [[-7]], "scores": [1.0]}, "neither -100 nor a token id"),
    ({"tokens": [[1]], "masks": [[1]], "scores": [float("nan")]}, "non-finite"),
    ({"tokens": [[1]], "masks": [[1]], "scores": [1.0], "advantages": [[float("inf")]]},
     "non-finite"),
])
async def test_bad_groups_are_a_422_and_never_stored(redis: aioredis.Redis, body: Any,
                                                     message: str) -> None:
    async with api_client(redis) as client:
        for path, payload in (("/scored_data", body), ("/scored_data_list", [body])):
            response = await client.post(path, content=orjson.dumps(
                payload, option=orjson.OPT_SERIALIZE_NUMPY) if "nan" not in str(body)
                and "inf" not in str(body) else _with_non_finite(payload),
                headers={"Content-Type": "application/json"})
            assert response.status_code == 422, response.text
            assert message in str(response.json()["detail"])
        assert await redis.xlen("rollq:{atr:0}:scored") == 0
        assert (await client.get("/status")).json()["queue_size"] == 0


def _with_non_finite(payload: Any) -> bytes:
    import json

    return json.dumps(payload).encode()  # NaN / Infinity, as Python's json writes them


async def test_status_env_for_an_unknown_env_is_a_404(redis: aioredis.Redis) -> None:
    async with api_client(redis) as client:
        response = await client.request("GET", "/status-env", json={"env_id": 3})
        assert response.status_code == 404
        assert "not registered" in response.json()["detail"]


async def test_rejections_set_asides_and_redeliveries_are_counted(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    longer = atropos_group(1)
    longer["advantages"] = [[0.5] * (len(t) + 1) for t in longer["tokens"]]
    api = create_app(AtroposApiSettings(run="counted", redis_url=redis_server.url),
                     redis=real_redis)
    async with api.router.lifespan_context(api), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://atropos.test") as client:
        await client.post("/register", json={**REGISTRATION, "batch_size": 2})
        assert (await client.post("/scored_data", json=longer)).status_code == 200
        bad = {"tokens": [[1, 2]], "masks": [[1]], "scores": [1.0]}
        assert (await client.post("/scored_data_list", json=[bad])).status_code == 422
        first = (await client.get("/batch")).json()["batch"]
        await client.post("/register", json=REGISTRATION)  # a restarted trainer
        assert (await client.get("/batch")).json()["batch"] == first
        reply = await client.get("/metrics")
    counted = {sample.labels["event"]: sample.value
               for family in text_string_to_metric_families(reply.text)
               for sample in family.samples if sample.name == "rollq_atropos_events_total"}
    assert counted == {"rejected": 1, "fields_set_aside": 1, "batch_redelivered": 1}
    assert first[0]["advantages"] == longer["advantages"]  # kept verbatim
