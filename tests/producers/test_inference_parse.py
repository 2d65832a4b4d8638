"""Parsing the real vLLM 0.32 bodies captured in tests/fixtures/vllm, and the request bodies
the client sends for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollq.producers.inference import (
    Backoff,
    InferencePool,
    InferenceRequestError,
    InferenceResponseError,
    PromptTooLongError,
    SamplingParams,
)
from rollq.producers.inference.parse import parse_generate
from rollq.schemas import ContractError
from tests.producers.fake_vllm import SCALE_OUT_DISABLED

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"
URL = "http://vllm.test"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def replaying(captured: dict[str, Any], seen: list[dict[str, Any]]) -> httpx.MockTransport:
    """Answers every request with the captured response, remembering request bodies."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/is_paused"):
            return httpx.Response(200, json={"is_paused": False})
        if request.url.path.endswith("/render"):
            return httpx.Response(403, json=SCALE_OUT_DISABLED)
        seen.append(orjson.loads(request.content) if request.content else {})
        return httpx.Response(captured["status"], content=orjson.dumps(captured["response"]),
                              headers={"content-type": "application/json"})

    return httpx.MockTransport(handle)


def pool_for(transport: httpx.MockTransport, **options: Any) -> InferencePool:
    options.setdefault("backoff", Backoff(initial_s=0.001, max_s=0.001))
    return InferencePool([URL], model="rollq-tiny", transport=transport,
                         health_interval_s=None, **options)


@pytest.mark.parametrize("name", ["completions_token_ids_n4.json", "completions_text_n4.json",
                                  "completions_batch_prompts.json",
                                  "completions_prompt_logprobs.json",
                                  "completion_submitted_while_paused_wait.json"])
async def test_completions_parse_to_the_captured_ids_and_logprobs(name: str) -> None:
    captured = fixture(name)
    request = captured["request"]["body"]
    seen: list[dict[str, Any]] = []
    async with pool_for(replaying(captured, seen)) as pool:
        samples = await pool.complete(request["prompt"], n=request.get("n", 1),
                                      params=SamplingParams(max_tokens=request["max_tokens"]))
    choices = captured["response"]["choices"]
    assert len(samples) == len(choices)
    for sample, choice in zip(samples, choices, strict=True):
        assert sample.completion_ids == choice["token_ids"]
        assert sample.prompt_ids == choice["prompt_token_ids"]
        assert sample.logprobs == choice["logprobs"]["token_logprobs"]
        assert sample.finish_reason == choice["finish_reason"]
        assert sample.text == choice["text"]
    body = seen[0]
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 0 and body["model"] == "rollq-tiny"


async def test_text_logprobs_without_token_id_strings_still_parse() -> None:
    captured = fixture("completions_text_logprobs_strings.json")
    async with pool_for(replaying(captured, [])) as pool:
        [sample] = await pool.complete("Alice has 5 apples")
    choice = captured["response"]["choices"][0]
    assert sample.completion_ids == choice["token_ids"]
    assert sample.logprobs == choice["logprobs"]["token_logprobs"]


async def test_chat_parses_top_level_prompt_ids_and_content_logprobs() -> None:
    captured = fixture("chat_completions_n2.json")
    request = captured["request"]["body"]
    seen: list[dict[str, Any]] = []
    async with pool_for(replaying(captured, seen)) as pool:
        samples = await pool.chat(request["messages"], n=2, params=SamplingParams(max_tokens=8))
    response = captured["response"]
    for sample, choice in zip(samples, response["choices"], strict=True):
        assert sample.prompt_ids == response["prompt_token_ids"]
        assert sample.completion_ids == choice["token_ids"]
        assert sample.logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert sample.text == choice["message"]["content"]
        assert sample.reasoning is None
    assert seen[0]["logprobs"] is True and seen[0]["return_token_ids"] is True


async def test_chat_reads_reasoning_and_reasoning_content() -> None:
    captured = fixture("chat_completions_n2.json")
    response = json.loads(json.dumps(captured["response"]))
    response["choices"][0]["message"]["reasoning"] = "think"
    response["choices"][1]["message"]["reasoning_content"] = "older name"
    async with pool_for(replaying({"status": 200, "response": response}, [])) as pool:
        samples = await pool.chat([{"role": "user", "content": "hi"}], n=2)
    assert [s.reasoning for s in samples] == ["think", "older name"]


async def test_tokenize_returns_the_captured_tokens() -> None:
    cases = [("tokenize_messages.json", "messages"), ("tokenize_prompt.json", "prompt")]
    for name, kwargs in cases:
        captured = fixture(name)
        seen: list[dict[str, Any]] = []
        async with pool_for(replaying(captured, seen)) as pool:
            request = captured["request"]["body"]
            ids = await pool.tokenize(**{kwargs: request[kwargs]})
        assert ids == captured["response"]["tokens"]
        if kwargs == "messages":
            assert seen[0]["add_generation_prompt"] is True


async def test_model_info_is_discovered_from_models() -> None:
    captured = fixture("models.json")
    async with InferencePool([URL], transport=replaying(captured, []),
                             health_interval_s=None) as pool:
        info = await pool.model_info()
    assert (info.name, info.max_model_len) == ("rollq-tiny", 512)


@pytest.mark.parametrize(("name", "error", "param"), [
    ("error_prompt_too_long.json", PromptTooLongError, "input_tokens"),
    ("error_too_many_logprobs.json", InferenceRequestError, "logprobs"),
    ("error_bad_model.json", InferenceRequestError, "model"),
    ("error_chat_bad_messages.json", InferenceRequestError, "body.messages"),
])
async def test_4xx_bodies_raise_a_contract_error_with_the_server_message(
        name: str, error: type[InferenceRequestError], param: str) -> None:
    captured = fixture(name)
    seen: list[dict[str, Any]] = []
    async with pool_for(replaying(captured, seen), max_retries=3) as pool:
        with pytest.raises(error) as caught:
            await pool.complete([5, 5, 5])
    assert isinstance(caught.value, ContractError)
    assert caught.value.server_message == captured["response"]["error"]["message"]
    assert caught.value.param == param and caught.value.status == captured["status"]
    assert len(seen) == 1  # never retried


async def test_unknown_route_detail_body_is_the_message() -> None:
    captured = fixture("error_unknown_route.json")
    async with pool_for(replaying(captured, [])) as pool:
        with pytest.raises(InferenceRequestError, match="Not Found"):
            await pool.complete("hi")


async def test_missing_token_ids_is_a_response_error() -> None:
    captured = fixture("completions_no_model_field.json")
    async with pool_for(replaying(captured, [])) as pool:
        with pytest.raises(InferenceResponseError, match="return_token_ids"):
            await pool.complete("Bob")


def token_in(render: dict[str, Any], generate: dict[str, Any],
             seen: list[tuple[str, dict[str, Any]]]) -> httpx.MockTransport:
    """A server with vLLM's token-in API (``--enable-scale-out``): the captured render, then
    the captured generate answer."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        seen.append((request.url.path, body))
        captured = {"/v1/completions/render": render,
                    "/inference/v1/generate": generate}[request.url.path]
        return httpx.Response(captured["status"], content=orjson.dumps(captured["response"]),
                              headers={"content-type": "application/json"})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("name", ["generate_text_n2.json",
                                  "generate_text_version_switch.json"])
async def test_completions_go_token_in_where_the_server_can_and_carry_its_weight_spans(
    name: str,
) -> None:
    render, generate = fixture("completions_render.json"), fixture(name)
    seen: list[tuple[str, dict[str, Any]]] = []
    async with pool_for(token_in(render, generate, seen)) as pool:
        samples = await pool.complete([5, 6, 7], n=2, params=SamplingParams(max_tokens=6))
    assert [path for path, _ in seen] == ["/v1/completions/render", "/inference/v1/generate"]
    assert seen[0][1]["prompt"] == [5, 6, 7] and seen[0][1]["n"] == 2
    assert seen[1][1]["output_mode"] == "text"  # the rendered request, asking for text
    assert seen[1][1]["token_ids"] == render["response"][0]["token_ids"]
    for sample, choice in zip(samples, generate["response"]["choices"], strict=True):
        assert sample.prompt_ids == [5, 6, 7]
        assert sample.completion_ids == choice["token_ids"]
        assert sample.logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert sample.text == choice["text"]
        spans = choice["weight_versions"]
        assert [(s.version, s.start, s.end) for s in sample.weight_versions or ()] == [
            (s["version"], s["start"], s["end"]) for s in spans]
        # "default" (no sync reached the server yet) is the version read before the call
        versions = sample.versions(4)
        expected = [4 if s["version"] == "default" else int(s["version"])
                    for s in spans for _ in range(s["end"] - s["start"])]
        assert versions == expected
        completion = sample.to_completion(4)
        assert completion.policy_version == expected[0]
        assert (completion.token_versions is None) == (len(set(expected)) == 1)


def test_weight_spans_that_do_not_tile_the_output_are_a_response_error() -> None:
    choice = fixture("generate_text_n2.json")["response"]["choices"][0]
    count = len(choice["token_ids"])
    for spans in ([{"version": "1", "start": 1, "end": count}],
                  [{"version": "1", "start": 0, "end": count - 1}],
                  [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3,
                                                            "end": count}],
                  "1"):
        with pytest.raises(InferenceResponseError, match="weight_versions"):
            parse_generate({"choices": [{**choice, "weight_versions": spans}]}, [1])


async def test_a_refused_render_that_is_not_a_missing_api_is_the_requests_error() -> None:
    render = {"status": 404, "response": {"error": {
        "message": "The model `nope` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}}
    seen: list[tuple[str, dict[str, Any]]] = []
    async with pool_for(token_in(render, render, seen)) as pool:
        with pytest.raises(InferenceRequestError, match="does not exist"):
            await pool.complete("hi", params=SamplingParams(max_tokens=2))
        assert pool.servers[0].generate_api is None  # still unknown: asked again next time
