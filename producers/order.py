"""The order in which a run's epochs visit the dataset.

Jobs address items by position (``epoch × items + index``, the feeder's cursor). By default
position ``p`` rolls out item ``p % items``: every epoch walks the dataset in the same order,
so a small dataset's per-item difficulty shows up as a sawtooth in the reward curve with the
period of an epoch. With a *shuffle seed* (``rollq feed --shuffle-seed N``), each epoch
visits the items in its own permutation, drawn from ``(seed, epoch)``: deterministic (a
re-run of a job, a requeue, any worker rolls out the same item for a position), and every
epoch still visits each item exactly once.

The feeder records the seed in the run's state hash (first feeder wins; another seed later
is a ``ConfigError``), and workers read it there, so they need no flag of their own.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import redis.asyncio as aioredis

from rollq.schemas import ConfigError
from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import state_key

SHUFFLE_SEED_FIELD = "shuffle_seed"
"""State-hash field: the run's shuffle seed (absent: dataset order)."""


def item_index(position: int, items: int, seed: int | None) -> int:
    """The dataset index that ``position`` rolls out."""
    epoch, index = divmod(position, items)
    if seed is None:
        return index
    return int(_permutation(items, seed, epoch)[index])


@lru_cache(maxsize=4)  # the epoch in hand and its neighbours
def _permutation(items: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(items)


async def record_seed(redis: aioredis.Redis, run: str, seed: int | None) -> None:
    """Record the run's shuffle seed; ``ConfigError`` when the run already has another
    order (its epochs so far were drawn with it)."""
    async with translated_errors("recording the shuffle seed"):
        if seed is not None:
            await redis.hsetnx(state_key(run), SHUFFLE_SEED_FIELD, str(seed))
        stored = await redis.hget(state_key(run), SHUFFLE_SEED_FIELD)
    if (None if stored is None else int(stored)) != seed:
        in_force = "dataset order" if stored is None else f"--shuffle-seed {int(stored)}"
        raise ConfigError(f"run {run!r} was fed with {in_force}: feed it the same way (its "
                          "positions so far map to items that way)")


async def read_seed(redis: aioredis.Redis, run: str) -> int | None:
    """The run's shuffle seed (None: dataset order)."""
    async with translated_errors("reading the shuffle seed"):
        stored = await redis.hget(state_key(run), SHUFFLE_SEED_FIELD)
    return None if stored is None else int(stored)
