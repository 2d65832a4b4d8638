"""Putting rollout jobs on the arq queue, as the feeder would, for tests that run workers."""

from __future__ import annotations

from collections.abc import Iterable

from rollq.producers.worker import connect_queue, enqueue_rollout


async def enqueue_positions(url: str, run: str, env: str, positions: Iterable[int]) -> None:
    """One rollout job per dataset position of ``env``, each one new to the queue."""
    queue = await connect_queue(url)
    try:
        for position in positions:
            assert await enqueue_rollout(queue, run, env, position)
    finally:
        await queue.aclose()
