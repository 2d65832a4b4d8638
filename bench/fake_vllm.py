"""The zero-latency fake vLLM server of ``bench.workers`` (the chaos and soak benchmarks and
some tests run it too): a raw asyncio HTTP/1.1 keep-alive server that answers
``/v1/chat/completions`` at once with ``n`` choices of ``max_tokens`` tokens each, in the
body shape of vLLM 0.32 (bodies precomputed per ``(n, max_tokens)``), and
``FakeServerProcess``, which runs it in a process of its own (``python -m bench.workers
--serve-fake PORT``)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import free_port

MODEL = "rollq-tiny"
REPO_ROOT = Path(__file__).resolve().parent.parent

_PROMPT_IDS = [1, 386, 280, 201, *range(300, 340), 2, 201, 1, 379, 550, 201]


def _choice(index: int, tokens: int, rng: random.Random) -> dict[str, Any]:
    ids = [rng.randrange(3, 768) for _ in range(tokens)]
    pieces = [bytes(rng.randrange(32, 127) for _ in range(rng.randint(1, 4))) for _ in ids]
    content = [
        {"token": f"token_id:{token}", "logprob": -rng.uniform(5.0, 8.0),
         "bytes": list(piece), "top_logprobs": []}
        for token, piece in zip(ids, pieces, strict=True)
    ]
    return {
        "index": index,
        "message": {"role": "assistant", "content": b"".join(pieces).decode(), "refusal": None,
                    "annotations": None, "audio": None, "function_call": None,
                    "reasoning": None},
        "logprobs": {"content": content},
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": ids,
        "routed_experts": None,
    }


def _chat_body(n: int, tokens: int) -> bytes:
    rng = random.Random(n * 100_003 + tokens)
    return orjson.dumps({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
        "model": MODEL,
        "choices": [_choice(i, tokens, rng) for i in range(n)],
        "service_tier": None, "system_fingerprint": "vllm-0.32.0-fake",
        "usage": {"prompt_tokens": len(_PROMPT_IDS), "completion_tokens": n * tokens,
                  "total_tokens": len(_PROMPT_IDS) + n * tokens,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": _PROMPT_IDS, "prompt_text": None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    })


def _http(status: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


_STATIC = {
    b"/health": _http("200 OK", b""),
    b"/is_paused": _http("200 OK", b'{"is_paused":false}'),
    b"/v1/models": _http("200 OK", orjson.dumps({"object": "list", "data": [{
        "id": MODEL, "object": "model", "owned_by": "vllm", "root": "fake",
        "max_model_len": 4096}]})),
    b"/tokenize": _http("200 OK", orjson.dumps({"count": len(_PROMPT_IDS), "max_model_len": 4096,
                                                "tokens": _PROMPT_IDS, "token_strs": None})),
}
_NOT_FOUND = _http("404 Not Found", b'{"detail":"Not Found"}')


class _FakeVllmProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive with Content-Length bodies (what httpx sends); answers at once."""

    cache: dict[tuple[int, int], bytes] = {}  # noqa: RUF012  # shared by every connection

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            length = 0
            at = head.lower().find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17: stop if stop >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4: total])
            del self.buffer[:total]
            path = head.split(b" ", 2)[1].split(b"?", 1)[0]
            assert self.transport is not None
            self.transport.write(self.respond(path, body))

    def respond(self, path: bytes, body: bytes) -> bytes:
        if path == b"/v1/chat/completions":
            request = orjson.loads(body)
            key = (int(request.get("n") or 1), int(request.get("max_tokens") or 16))
            reply = self.cache.get(key)
            if reply is None:
                reply = self.cache[key] = _http("200 OK", _chat_body(*key))
            return reply
        return _STATIC.get(path, _NOT_FOUND)


async def serve_fake(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_FakeVllmProtocol, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


class FakeServerProcess:
    """The fake server in its own process (``python -m bench.workers --serve-fake PORT``)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeServerProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.workers", "--serve-fake", str(self.port)],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("the fake vLLM server did not start")

    def cpu_s(self) -> float:
        return _process_cpu_s(self.process.pid) if self.process is not None else float("nan")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (NaN where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
