"""Shared by the Atropos API tests: the app in-process, and groups as envs post them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import redis.asyncio as aioredis

from ops.atropos.app import create_app
from ops.atropos.settings import AtroposApiSettings

REGISTRATION = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4,
                "max_token_len": 512, "checkpoint_dir": "/tmp/ckpt",
                "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 100}


def env_registration(name: str = "gsm8k", group_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {"max_token_length": 512, "desired_name": name, "weight": 1.0,
            "group_size": group_size, **extra}


def atropos_group(marker: int, size: int = 2, env_id: int | None = 0,
                  prompt: int = 3, completion: int = 4, **extra: Any) -> dict[str, Any]:
    """A group as atroposlib's env posts it: a shared masked prompt, then completions
    whose masks are the token ids (labels). ``marker`` is the first prompt token."""
    prompt_ids = [marker, *range(10, 10 + prompt - 1)]
    tokens, masks, logprobs = [], [], []
    for i in range(size):
        done = [100 + marker + i + j for j in range(completion + i)]
        tokens.append(prompt_ids + done)
        masks.append([-100] * prompt + done)
        logprobs.append([1.0] * prompt + [-0.5 - j / 8 for j in range(len(done))])
    group = {"tokens": tokens, "masks": masks, "scores": [float(i % 2) for i in range(size)],
             "inference_logprobs": logprobs, "env_id": env_id}
    group.update(extra)
    return group


@asynccontextmanager
async def api_client(redis: aioredis.Redis, run: str = "atr",
                     **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(AtroposApiSettings(run=run, **settings), redis=redis)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://atropos.test") as client:
        yield client


def marker_of(group: dict[str, Any]) -> int:
    return int(group["tokens"][0][0])
