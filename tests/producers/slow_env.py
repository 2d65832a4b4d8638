"""An env for process-level tests: the gsm8k sample, each rollout sleeping first."""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.producers.envs.base import Item, Rollout
from rollq.producers.envs.registry import make_env


class SlowEnv:
    def __init__(self, seconds: float = 2.0) -> None:
        self.inner = make_env("gsm8k")
        self.name = self.inner.name
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.inner)

    def item(self, index: int) -> Item:
        return self.inner.item(index)

    async def rollout(self, item: Item, pool: Any, **kwargs: Any) -> Rollout:
        await asyncio.sleep(self.seconds)
        return await self.inner.rollout(item, pool, **kwargs)
