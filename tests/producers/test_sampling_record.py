"""Each sample records how it was sampled (issue 44): the request's temperature, top_p,
top_k and min_p, the model named, and the server's logprobs mode, declared or asked of the
server (``/server_info``); and, from a MoE server, the experts it routed each position to."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from rollq.producers.inference import InferencePool, SamplingParams
from rollq.producers.inference.errors import InferenceResponseError
from rollq.producers.inference.parse import parse_completions
from rollq.schemas.models import SamplingRecord
from tests.producers.fake_vllm import FakeVLLM, fake_transport


@pytest.mark.parametrize(("declared", "served", "recorded", "asked"), [
    ("auto", "processed_logprobs", "processed_logprobs", 1),  # the server says
    ("auto", None, None, 1),  # not in dev mode: it cannot say, asked once
    ("raw_logprobs", "processed_logprobs", "raw_logprobs", 0),  # the operator's word
    (None, "raw_logprobs", None, 0),  # a bare pool records nothing it was not told
])
async def test_the_logprobs_mode_is_declared_or_asked_once(
        declared: str | None, served: str | None, recorded: str | None, asked: int) -> None:
    fake = FakeVLLM("http://a.test")
    fake.logprobs_mode = served
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, extra={"min_p": 0.05})
    async with InferencePool([fake.base_url], transport=fake_transport(fake),
                             health_interval_s=None, logprobs_mode=declared) as pool:
        for _ in range(2):
            samples = await pool.complete("hi", n=2, params=params)
    assert [s.sampling for s in samples] == [SamplingRecord(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, logprobs_mode=recorded,
        model="rollq-tiny")] * 2
    assert fake.counts["/server_info"] == asked
    completion = samples[0].to_completion(3)
    assert completion.sampling == samples[0].sampling


async def test_fields_left_to_the_server_are_recorded_as_not_known() -> None:
    fake = FakeVLLM("http://a.test")
    async with InferencePool([fake.base_url], transport=fake_transport(fake),
                             health_interval_s=None) as pool:
        [sample] = await pool.chat([{"role": "user", "content": "hi"}], n=1)
    assert sample.sampling == SamplingRecord(temperature=1.0, top_p=1.0, model="rollq-tiny")


def _body(routed: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
                         "prompt_token_ids": [1, 2, 3], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5, -0.25]},
                         "routed_experts": routed}]}


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def test_routed_experts_are_parsed_from_vllms_base64_npy() -> None:
    experts = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)  # 3 + 2 - 1 positions
    [choice] = parse_completions(_body(_npy(experts)))
    assert np.array_equal(choice.routed_experts, experts)
    assert choice.routed_experts.dtype == np.uint8
    [plain] = parse_completions(_body(None))
    assert plain.routed_experts is None
    with pytest.raises(InferenceResponseError, match=r"shape \(5, 2, 2\)"):
        parse_completions(_body(_npy(np.zeros((5, 2, 2), np.uint8))))
    with pytest.raises(InferenceResponseError, match=r"base64 \.npy"):
        parse_completions(_body("not base64!"))


async def test_with_lora_each_generation_names_the_adapter_of_the_version_it_read() -> None:
    fake = FakeVLLM("http://a.test")
    fake.adapters.add("policy-v3")
    versions = iter([0, 3])

    async def policy_version() -> int:
        return next(versions)

    async with InferencePool([fake.base_url], transport=fake_transport(fake),
                             health_interval_s=None, lora_name="policy",
                             policy_version=policy_version) as pool:
        [base] = await pool.complete("hi", n=1)
        [adapted] = await pool.complete("hi", n=1)
    models = [body["model"] for path, body in fake.requests if path == "/v1/completions"]
    assert models == ["rollq-tiny", "policy-v3"]
    assert base.versions(7) == [0] * len(base.completion_ids)  # exact: not the version read
    assert adapted.to_completion(7).policy_version == 3
    assert adapted.sampling is not None and adapted.sampling.model == "policy-v3"
