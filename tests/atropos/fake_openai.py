"""A loopback OpenAI-compatible fake for Atropos envs in ``serve`` mode (their ``openai``
server type): ``/v1/chat/completions`` and ``/v1/models``.

Each reply answers the last user message's arithmetic: the sum of the integers in it, as
``<think>adding</think> #### <sum>``. Replies alternate between right and wrong (by a
running count of choices served), so every group of two or more completions has scores
that differ, as atroposlib's ``ensure_scores_are_not_same`` wants.

    python -m tests.atropos.fake_openai --port P
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def answer(text: str) -> int:
    """The right answer to a prompt: the sum of the integers in it."""
    return sum(int(number) for number in re.findall(r"-?\d+", text))


def create_app() -> Starlette:
    served = itertools.count()

    async def chat(request: Request) -> JSONResponse:
        body: dict[str, Any] = await request.json()
        question = next(m["content"] for m in reversed(body["messages"])
                        if m["role"] == "user")
        right = answer(question)
        choices = []
        for index in range(int(body.get("n") or 1)):
            value = right if next(served) % 2 == 0 else right + 1
            choices.append({"index": index, "finish_reason": "stop", "logprobs": None,
                            "message": {"role": "assistant",
                                        "content": f"<think>adding</think> #### {value}"}})
        return JSONResponse({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "fake"), "choices": choices,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": "fake", "object": "model", "created": 0, "owned_by": "rollq"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
