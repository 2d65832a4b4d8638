"""An OpenAI-compatible fake of vLLM on ``httpx.MockTransport``, shaped like vLLM 0.32.

Response bodies follow the captured fixtures in ``tests/fixtures/vllm`` (``token_ids``,
``prompt_token_ids``, ``logprobs.token_logprobs`` with ``token_id:N`` tokens, chat's
top-level ``prompt_token_ids``, error bodies). Deterministic: a choice's tokens depend only
on the prompt ids, the request seed and the choice index.

The fake tokenizer maps one character to one token (``id = 100 + ord(c)``) and the chat
template is ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n``, so tests can read ids back.

Usage::

    fake = FakeVLLM("http://a.test")
    async with InferencePool([fake.base_url], transport=fake_transport(fake)) as pool: ...

Tests steer it through attributes and methods: ``latency_s``, ``down`` (every request,
``/health`` included, fails to connect), ``fail_next(kind, count)`` (``connect``, ``timeout``,
``500``, ``400``), ``inject_faults(...)`` (a seeded fraction of calls failing with 5xx or a
refused connection, and a fraction answering only after ``slow_s``: longer than a job
timeout), ``pause(mode)``/``resume()`` (or HTTP ``/pause``, ``/resume``), and
``responder`` (prompt text, choice index → reply text) for scripted replies.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import httpx
import orjson

IM_START, IM_END = 1, 2  # as the tiny model of the captured fixtures
EOS = IM_END
TEXT_OFFSET = 100
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize")


SCALE_OUT_DISABLED = {"error": {
    "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
               "to enable them.", "type": "PermissionDeniedError", "param": None, "code": 403}}
"""What vLLM 0.32 answers on its token-in routes unless started with --enable-scale-out."""


def encode_text(text: str) -> list[int]:
    """The fake tokenizer: one token per character."""
    return [TEXT_OFFSET + ord(char) for char in text]


def decode_ids(ids: list[int]) -> str:
    names = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
    return "".join(names.get(i, chr(i - TEXT_OFFSET) if i >= TEXT_OFFSET else "?") for i in ids)


def render_chat(messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool = False) -> list[int]:
    """The fake ChatML chat template, as token ids."""
    ids: list[int] = []
    for position, message in enumerate(messages):
        ids += [IM_START, *encode_text(f"{message['role']}\n{message['content']}")]
        if continue_final_message and position == len(messages) - 1:
            return ids
        ids += [IM_END, *encode_text("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode_text("assistant\n")]
    return ids


def logprob_of(token: int, index: int) -> float:
    """The fake sampler's logprob of a token (deterministic)."""
    return -round(0.05 + (token % 13) / 10 + index / 100, 6)


class FakeVLLM:
    """One fake server; see the module docstring."""

    def __init__(self, base_url: str = "http://vllm-0.test", *, model: str = "rollq-tiny",
                 max_model_len: int = 512, latency_s: float = 0.0) -> None:
        self.base_url = base_url
        self.model = model
        self.max_model_len = max_model_len
        self.latency_s = latency_s
        self.down = False
        self.responder: Callable[[str, int], str] | None = None
        self.paused = False
        self.pause_mode = "abort"
        self.counts: Counter[str] = Counter()
        self.requests: list[tuple[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._failures: deque[str] = deque()
        self._faults: Faults | None = None
        self.injected: Counter[str] = Counter()
        """Faults injected so far, by kind (``connect``, ``503``, ``slow``...)."""
        self.adapters: set[str] = set()
        """LoRA adapter names served beside the model (requests may name them)."""
        self.logprobs_mode: str | None = None
        """Set: ``/server_info`` answers it, as vLLM in dev mode does (else 404)."""
        self._resumed: asyncio.Event | None = None
        self._abort: asyncio.Event | None = None

    # --- steering ----------------------------------------------------------------------

    def fail_next(self, kind: str, count: int = 1) -> None:
        """Make the next ``count`` generation/tokenize requests fail with ``kind``."""
        self._failures.extend([kind] * count)

    def inject_faults(self, *, failure_rate: float, slow_rate: float = 0.0,
                      slow_s: float = 60.0, kinds: tuple[str, ...] = ("connect", "503"),
                      paths: tuple[str, ...] = GENERATION_PATHS, seed: int = 0) -> None:
        """From now on each call of ``paths`` fails with probability ``failure_rate`` (a
        kind drawn from ``kinds``, as in ``fail_next``), or else with probability
        ``slow_rate`` answers only after ``slow_s``; seeded, so a run repeats."""
        self._faults = Faults(failure_rate, slow_rate, slow_s, kinds, paths,
                              random.Random(seed))

    def pause(self, mode: str = "abort") -> None:
        self.paused, self.pause_mode = True, mode
        if mode == "abort" and self._abort is not None:
            self._abort.set()

    def resume(self) -> None:
        self.paused = False
        if self._resumed is not None:
            self._resumed.set()

    # --- HTTP --------------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body: Any = orjson.loads(request.content) if request.content else None
        self.counts[path] += 1
        self.requests.append((path, body))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return httpx.Response(200)
        if path == "/is_paused":
            return _json({"is_paused": self.paused})
        if path == "/pause":
            self.pause(request.url.params.get("mode", "abort"))
            return _json({"status": "paused"})
        if path == "/resume":
            self.resume()
            return _json({"status": "resumed"})
        if path == "/server_info" and self.logprobs_mode is not None:
            return _json({"vllm_config": {"model_config": {
                "logprobs_mode": self.logprobs_mode}}, "vllm_env": {}, "system_env": {}})
        if path.endswith("/render") or path.startswith("/inference/"):
            return _json(SCALE_OUT_DISABLED, 403)  # vLLM started without --enable-scale-out
        if path == "/v1/models":
            return _json({"object": "list", "data": [{
                "id": self.model, "object": "model", "owned_by": "vllm",
                "max_model_len": self.max_model_len}]})
        failure = self._failures.popleft() if self._failures else None
        if failure is None and self._faults is not None and path in self._faults.paths:
            failure = self._faults.draw()
            if failure is not None:
                self.injected[failure] += 1
            if failure == "slow":
                await asyncio.sleep(self._faults.slow_s)
                failure = None
        if failure is not None:
            if failure == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            if failure == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            status = int(failure)
            return _json(_error(f"injected {status}", "Injected", None, status), status)
        if path == "/tokenize":
            return self._tokenize(body)
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await self._generate(path, body)
            finally:
                self.in_flight -= 1
        return _json({"detail": "Not Found"}, 404)

    def _tokenize(self, body: dict[str, Any]) -> httpx.Response:
        if "messages" in body:
            ids = render_chat(body["messages"],
                              add_generation_prompt=body.get("add_generation_prompt", True),
                              continue_final_message=body.get("continue_final_message", False))
        else:
            ids = encode_text(body["prompt"])  # the model has no BOS
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                      "token_strs": None})

    async def _generate(self, path: str, body: dict[str, Any]) -> httpx.Response:
        if body.get("model") != self.model and body.get("model") not in self.adapters:
            return _json(_error(f"The model `{body.get('model')}` does not exist.",
                                "NotFoundError", "model", 404), 404)
        chat = path.endswith("chat/completions")
        if chat:
            prompt_ids = render_chat(body["messages"], add_generation_prompt=True)
        else:
            prompt = body["prompt"]
            prompt_ids = prompt if isinstance(prompt, list) else encode_text(prompt)
        if len(prompt_ids) > self.max_model_len:
            return _json(_error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(prompt_ids)} input tokens, which exceeds this limit "
                f"even without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(prompt_ids)})",
                "BadRequestError", "input_tokens", 400), 400)
        while self.paused:  # vLLM holds requests submitted while paused until /resume
            self._resumed = self._resumed or asyncio.Event()
            await self._resumed.wait()
            self._resumed = None
        max_tokens = min(body.get("max_tokens") or 16, self.max_model_len - len(prompt_ids))
        choices = [self._choice(prompt_ids, body, i, max_tokens) for i in range(body.get("n", 1))]
        aborted = await self._wait_latency()
        if aborted:
            for choice in choices:
                choice["token_ids"] = choice["token_ids"][:1]
                choice["finish_reason"] = "abort"
        return _json(_chat_body(choices, prompt_ids) if chat else _completion_body(choices))

    async def _wait_latency(self) -> bool:
        if self.latency_s <= 0:
            return False
        self._abort = self._abort or asyncio.Event()
        abort = self._abort
        try:
            await asyncio.wait_for(abort.wait(), self.latency_s)
        except TimeoutError:
            return False
        finally:
            if abort.is_set() and self._abort is abort:
                self._abort = None
        return True

    def _choice(self, prompt_ids: list[int], body: dict[str, Any], index: int,
                max_tokens: int) -> dict[str, Any]:
        key = orjson.dumps([prompt_ids, body.get("seed"), index])
        rng = random.Random(hashlib.sha256(key).digest())
        if self.responder is not None:
            ids = [*encode_text(self.responder(decode_ids(prompt_ids), index)), EOS]
        else:
            ids = [*(TEXT_OFFSET + rng.randrange(ord("a"), ord("z") + 1)
                     for _ in range(rng.randint(3, 10))), EOS]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        return {"index": index, "token_ids": ids, "finish_reason": finish,
                "prompt_token_ids": prompt_ids}


class Faults:
    """What ``FakeVLLM.inject_faults`` set up."""

    def __init__(self, failure_rate: float, slow_rate: float, slow_s: float,
                 kinds: tuple[str, ...], paths: tuple[str, ...], rng: random.Random) -> None:
        self.failure_rate = failure_rate
        self.slow_rate = slow_rate
        self.slow_s = slow_s
        self.kinds = kinds
        self.paths = paths
        self.rng = rng

    def draw(self) -> str | None:
        """A failure kind, ``slow``, or None (a normal answer)."""
        roll = self.rng.random()
        if roll < self.failure_rate:
            return self.rng.choice(self.kinds)
        if roll < self.failure_rate + self.slow_rate:
            return "slow"
        return None


def fake_transport(*servers: FakeVLLM) -> httpx.MockTransport:
    """One transport routing each request to the fake whose host it names."""
    by_host = {httpx.URL(server.base_url).host: server for server in servers}

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].handle(request)

    return httpx.MockTransport(route)


def _json(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, content=orjson.dumps(body),
                          headers={"content-type": "application/json"})


def _error(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _text(ids: list[int]) -> str:
    return decode_ids([i for i in ids if i != EOS])


def _completion_body(choices: list[dict[str, Any]]) -> dict[str, Any]:
    out = []
    for choice in choices:
        ids = choice["token_ids"]
        logprobs = [logprob_of(t, choice["index"]) for t in ids]
        out.append({
            "index": choice["index"], "text": _text(ids),
            "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": logprobs,
                         "tokens": [f"token_id:{t}" for t in ids],
                         "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, logprobs,
                                                                                 strict=True)]},
            "finish_reason": choice["finish_reason"], "stop_reason": None, "token_ids": ids,
            "prompt_logprobs": None, "prompt_token_ids": choice["prompt_token_ids"],
        })
    return {"id": "cmpl-fake", "object": "text_completion", "model": "rollq-tiny",
            "choices": out}


def _chat_body(choices: list[dict[str, Any]], prompt_ids: list[int]) -> dict[str, Any]:
    out = []
    for choice in choices:
        ids = choice["token_ids"]
        text = _text(ids)
        reasoning = None
        if "</think>" in text:
            thought, _, text = text.partition("</think>")
            reasoning = thought.removeprefix("<think>")
        out.append({
            "index": choice["index"],
            "message": {"role": "assistant", "content": text, "reasoning": reasoning},
            "logprobs": {"content": [{"token": f"token_id:{t}",
                                      "logprob": logprob_of(t, choice["index"])} for t in ids]},
            "finish_reason": choice["finish_reason"], "stop_reason": None, "token_ids": ids,
        })
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": "rollq-tiny",
            "choices": out, "prompt_token_ids": prompt_ids}
