"""atroposlib's ``vllm`` server type on stock vLLM: its ``/generate`` route, token-exact.

atroposlib 0.4.0's ``VLLMServer`` (``atroposlib/envs/server_handling/vllm_server.py``) calls
``POST <base>/generate``, a route of Atropos' own patched vLLM server that stock vLLM lacks.
``generate`` answers that request from stock vLLM's ``/v1/completions`` through the capture
layer's ``Upstream`` (the pool's balancing, retries and pause handling), with the server's
own token ids and logprobs:

Request (what atroposlib sends): ``{"prompt": {"prompt_token_ids": [ids]}, "logprobs": k,
...}`` plus vLLM ``SamplingParams`` fields (``n``, ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop``, ``seed``…; ``model`` and ``stream`` are ignored, the served
model is always used). ``prompt`` may also be a string (vLLM tokenises it, with BOS).
``prompt_logprobs: k`` asks for the prompt's top-k logprobs (atroposlib's ``get_logprobs``).

Reply (what atroposlib reads): ``text`` (one per choice), ``prompt`` (the prompt text when
it was sent as text, else ""), ``finish_reasons``, ``prompt_token_ids`` (the ids the
server generated from), ``token_ids`` (per choice), ``logprobs`` (per choice, per token
``[{"<id>": logprob, ...}]``: the sampled token first, then the top-k when ``logprobs`` >
0), and ``prompt_logprobs`` (per prompt position ``{"<id>": logprob}`` or null) when asked.
The sampled token's logprob is the one vLLM's ``/v1/completions`` reports for the choice.

``passthrough`` serves the plain OpenAI routes of the same base URL (atroposlib's
``chat_completion`` and ``completion`` go there): the body is sent as is (any ``n``) with
the served model's name; nothing is captured.
"""

from __future__ import annotations

from typing import Any

from rollq.producers.inference.capture.upstream import Upstream
from rollq.producers.inference.errors import InferenceRequestError, InferenceResponseError
from rollq.producers.inference.parse import parse_completions

_NOT_SAMPLING = ("prompt", "stream", "model", "output_kind", "logprobs", "prompt_logprobs")
_TOKEN_ID = "token_id:"


def generate_request(body: dict[str, Any], model: str) -> tuple[dict[str, Any], str]:
    """The ``/v1/completions`` body of a ``/generate`` body, and the prompt text ("" for ids)."""
    prompt = body.get("prompt")
    text = ""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids")
    if isinstance(prompt, str):
        text = prompt
    elif not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        raise InferenceRequestError("prompt must be a string or {'prompt_token_ids': [ids]}",
                                    status=400, param="prompt")
    top = body.get("logprobs")
    top = top if type(top) is int and top > 0 else 0
    request = {key: value for key, value in body.items() if key not in _NOT_SAMPLING}
    if "max_new_tokens" in request:
        request["max_tokens"] = request.pop("max_new_tokens")
    request.update(model=model, prompt=prompt, logprobs=top, return_token_ids=True,
                   return_tokens_as_token_ids=True)
    prompt_top = body.get("prompt_logprobs")
    if type(prompt_top) is int and prompt_top >= 0:
        request["prompt_logprobs"] = prompt_top
    return request, text


def generate_reply(reply: dict[str, Any], prompt_text: str) -> dict[str, Any]:
    """The ``/generate`` answer of a ``/v1/completions`` reply (module docstring)."""
    samples = parse_completions(reply)
    choices = sorted(reply["choices"], key=lambda choice: int(choice.get("index", 0)))
    logprobs = []
    for sample, choice in zip(samples, choices, strict=True):
        tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
        rows = []
        for position, (token, logprob) in enumerate(zip(sample.completion_ids, sample.logprobs,
                                                        strict=True)):
            entry = {str(token): logprob}
            for key, value in (tops[position] or {}).items() if position < len(tops) else ():
                entry.setdefault(_token_key(key), value)
            rows.append([entry])
        logprobs.append(rows)
    answer: dict[str, Any] = {
        "text": [sample.text for sample in samples], "prompt": prompt_text,
        "finish_reasons": [sample.finish_reason for sample in samples],
        "prompt_token_ids": samples[0].prompt_ids,
        "token_ids": [sample.completion_ids for sample in samples],
        "logprobs": logprobs,
    }
    raw_prompt = choices[0].get("prompt_logprobs")
    if raw_prompt is not None:
        answer["prompt_logprobs"] = [_prompt_entry(entry) for entry in raw_prompt]
    return answer


async def generate(upstream: Upstream, body: dict[str, Any]) -> dict[str, Any]:
    """Answer atroposlib's ``/generate`` request ``body`` (module docstring).

    Raises ``InferenceRequestError`` (a bad request, or the server's 4xx),
    ``InferenceUnavailable`` (after the pool's retries) or ``InferenceResponseError``."""
    request, text = generate_request(body, await upstream.model())
    return generate_reply(await upstream.post("/v1/completions", request), text)


async def passthrough(upstream: Upstream, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST path`` (``/v1/chat/completions`` or ``/v1/completions``) as sent, with the
    served model's name; the server's reply."""
    return await upstream.post(path, {**body, "model": await upstream.model()})


def _token_key(key: str) -> str:
    return key[len(_TOKEN_ID):] if key.startswith(_TOKEN_ID) else key


def _prompt_entry(entry: Any) -> dict[str, float] | None:
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise InferenceResponseError("prompt_logprobs entry is not an object")
    out = {}
    for key, value in entry.items():
        logprob = value.get("logprob") if isinstance(value, dict) else value
        if not isinstance(logprob, int | float):
            raise InferenceResponseError("prompt_logprobs entry holds a non-number")
        out[_token_key(str(key))] = float(logprob)
    return out
