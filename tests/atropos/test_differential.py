"""Differential test: the same requests to atroposlib 0.4.0's own server and to rollq's
Atropos API, the same status codes and the same answers, batches included.

atroposlib's app runs in-process with its own (module-level, Redis-less) state, reloaded
per scenario; rollq's runs on the ``redis`` fixture (fakeredis and a real redis-server).
The scenarios are what sloppy envs and trainers send: per-token rows longer or shorter
than their tokens, empty / whitespace / numeric / missing message contents, empty
optional lists, integer scores, envs that never registered, a ``/scored_data_list`` of
exactly ``batch_size`` sequences (identical groups included), groups that cannot pack
into a batch, minimum allocations, gzip both ways. Where rollq answers differently on
purpose, the test for it is elsewhere and the difference is in docs/guides/atropos.md
(``test_endpoints.test_bad_groups_are_a_422_and_never_stored``).
"""

from __future__ import annotations

import gzip
import importlib
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from tests.atropos.helpers import REGISTRATION, api_client, atropos_group, env_registration

server = pytest.importorskip("atroposlib.api.server",
                             reason="atroposlib is not installed (pip install rollq[atropos])")


@dataclass(frozen=True)
class Step:
    """One request: ``gzip`` sends the body compressed (as atroposlib's env does for
    bodies of 1 KB or more); ``accept`` is the Accept-Encoding of the answer."""

    method: str
    path: str
    body: Any = None
    gzip: bool = False
    accept: str = "gzip, deflate"


def _get(path: str, body: Any = None, accept: str = "gzip, deflate") -> Step:
    return Step("GET", path, body, accept=accept)


def _post(path: str, body: Any, *, gzipped: bool = False) -> Step:
    return Step("POST", path, body, gzip=gzipped)


def _chat(*contents: Any) -> list[dict[str, Any]]:
    roles = ("system", "user", "assistant", "user", "assistant")
    return [{"role": role, "content": content} for role, content in zip(roles, contents,
                                                                         strict=False)]


def _sloppy_groups() -> list[dict[str, Any]]:
    """Groups atroposlib's server takes as posted, one oddity each."""
    longer = atropos_group(1)  # advantages one value longer than the tokens (issue 32)
    longer["advantages"] = [[0.5] * (len(t) + 1) for t in longer["tokens"]]
    shorter = atropos_group(2)
    shorter["advantages"] = [[0.25] * (len(t) - 2) for t in shorter["tokens"]]
    shorter["inference_logprobs"] = [[*row, -1.0] for row in shorter["inference_logprobs"]]
    contents = atropos_group(3, messages=[_chat("", "   ", "42"), _chat("\n", "7", 7.5)])
    missing = atropos_group(4, messages=[_chat("s", None, ""), [
        {"role": "user", "content": "q", "reward": 1.0},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]])
    empty_lists = atropos_group(5, advantages=[], ref_logprobs=[], overrides=[], images=[],
                                generation_params={}, group_overrides={})
    integer_scores = atropos_group(6)
    integer_scores["scores"] = [1, 0]
    no_logprobs = atropos_group(7)
    del no_logprobs["inference_logprobs"]
    extras = atropos_group(
        8, ref_logprobs=[[-0.1] * 7, [-0.2] * 8], overrides=[{"set_advantage_to_zero": 1}, {}],
        distill_token_ids=[[[1, 2]] * 7, [[3]] * 8],
        distill_logprobs=[[[-0.5, -1.5]] * 7, [[-0.25]] * 8])
    return [longer, shorter, contents, missing, empty_lists, integer_scores, no_logprobs,
            extras]


def _scenarios() -> dict[str, list[Step]]:
    registration = {**REGISTRATION, "batch_size": 4}
    started = [_post("/register", registration), _get("/batch"),
               _post("/register-env", env_registration())]
    sloppy = _sloppy_groups()
    same = atropos_group(20)
    return {
        "sloppy bodies, one at a time and in lists, gzip both ways": [
            *started,
            *(_post("/scored_data", group) for group in sloppy[:4]),
            _get("/status"), _get("/status-env", {"env_id": 0}), _get("/latest_example"),
            _get("/batch"), _get("/batch", accept="identity"),
            _post("/scored_data_list", sloppy[4:], gzipped=True),
            _get("/latest_example"), _get("/batch", accept="identity"), _get("/batch"),
            _get("/batch"), _get("/status"),
        ],
        "a list of exactly batch_size sequences, identical groups included": [
            *started,
            _post("/scored_data_list", [same, same]),
            _get("/status"), _get("/batch"), _get("/batch"),
            _post("/scored_data_list", [atropos_group(21, size=1, env_id=None)] * 4,
                  gzipped=True),
            _get("/batch"), _get("/status"),
            _post("/scored_data_list", []),
            _get("/batch"),
        ],
        "groups from unregistered envs, mixed sizes, some never packable": [
            *started,
            _post("/scored_data", atropos_group(30, size=1, env_id=None)),
            _post("/scored_data", atropos_group(31, size=4, env_id=None)),
            _post("/scored_data", atropos_group(32, size=3, env_id=None)),  # packs with no one
            _post("/scored_data", atropos_group(33, size=2, env_id=9)),  # no env 9: queued
            _post("/scored_data", atropos_group(34, size=1, env_id=None)),
            _get("/status"), _get("/batch"), _get("/batch"), _get("/status"),
            _post("/scored_data", atropos_group(35, size=2, env_id=None)),
            _get("/batch"), _get("/batch"), _get("/status"),
        ],
        "buffered mixed-size groups of a registered env": [
            *started,
            _post("/register-env", env_registration("wide", 4)),
            _post("/scored_data", atropos_group(40, size=1, env_id=1)),
            _post("/scored_data", atropos_group(41, size=3, env_id=1)),  # completes 4
            _post("/scored_data_list", [atropos_group(42, size=2, env_id=1),
                                        atropos_group(43, size=1, env_id=1),
                                        atropos_group(44, size=1, env_id=1)]),
            _get("/status-env", {"env_id": 1}), _get("/batch"), _get("/batch"),
            _get("/status"),
        ],
        "minimum allocations": [
            _post("/register", {**REGISTRATION, "batch_size": 8}), _get("/batch"),
            _post("/register-env", env_registration("a", 2, min_batch_allocation=0.5)),
            _post("/register-env", env_registration("b", 2, min_batch_allocation=0.25)),
            *(_post("/scored_data", atropos_group(50 + i, env_id=i % 2)) for i in range(6)),
            _post("/scored_data", atropos_group(60, env_id=None)),
            _get("/status-env", {"env_id": 0}), _get("/status-env", {"env_id": 1}),
            _get("/batch"), _get("/batch"), _get("/status"),
            _post("/disconnect-env", {"env_id": 1}),
            *(_post("/scored_data", atropos_group(70 + i, env_id=0)) for i in range(3)),
            _get("/batch"), _get("/status"),
        ],
        "a trainer that registers late": [  # a post before it: test_posts_before_register
            _get("/latest_example"), _get("/batch"), _get("/info"), _get("/status"),
            _post("/register", registration), _get("/info"), _get("/batch"),
            _post("/register", {**registration, "batch_size": 2}),  # the first one holds
            _get("/info"), _post("/scored_data", atropos_group(80, env_id=None)),
            _get("/status"), _get("/batch"), _get("/batch"), _get("/status"),
        ],
    }


async def _play(client: httpx.AsyncClient, steps: list[Step]) -> list[tuple[int, Any]]:
    answers = []
    for step in steps:
        headers = {"Accept-Encoding": step.accept}
        content = None
        if step.body is not None:
            content = orjson.dumps(step.body)
            headers["Content-Type"] = "application/json"
            if step.gzip:
                content = gzip.compress(content)
                headers["Content-Encoding"] = "gzip"
        response = await client.request(step.method, step.path, content=content,
                                         headers=headers)
        try:
            payload: Any = response.json()
        except ValueError:
            payload = response.text
        if isinstance(payload, dict) and "uuid" in payload:
            payload["uuid"] = "<uuid>"
        answers.append((response.status_code, payload))
    return answers


@pytest.mark.parametrize("name", list(_scenarios()))
async def test_rollq_answers_as_atroposlib_does(redis: aioredis.Redis, name: str) -> None:
    steps = _scenarios()[name]
    reference = importlib.reload(server)  # atroposlib keeps its state on a module-level app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=reference.app),
                                 base_url="http://atroposlib.test") as client:
        theirs = await _play(client, steps)
    async with api_client(redis, run="differential") as client:
        ours = await _play(client, steps)
    batches = 0
    for step, mine, expected in zip(steps, ours, theirs, strict=True):
        assert mine == expected, f"{step.method} {step.path} {step.body!r:.200}"
        if step.path == "/batch" and isinstance(expected[1], dict) and expected[1].get("batch"):
            batches += 1
    assert batches > 0 or name == "a trainer that registers late"  # something to compare


async def test_posts_before_register_are_kept_for_the_trainer(redis: aioredis.Redis) -> None:
    """A difference on purpose (docs/guides/atropos.md): atroposlib's ``/register`` skips its set-up
    when a group was posted before it, and its ``/batch`` then answers "not registered"
    for good; rollq keeps the group and batches it once a trainer registers."""
    reference = importlib.reload(server)
    steps = [_post("/scored_data", atropos_group(1, env_id=None)),
             _post("/register", {**REGISTRATION, "batch_size": 2}), _get("/batch")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=reference.app),
                                 base_url="http://atroposlib.test") as client:
        theirs = await _play(client, steps)
    assert theirs[-1][1]["message"] == "Trainer not registered. Call /register first."
    async with api_client(redis, run="early") as client:
        ours = await _play(client, steps)
    assert ours[-1][1]["batch"][0]["tokens"] == atropos_group(1)["tokens"]
