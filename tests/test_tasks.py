"""``schemas.tasks.beside``: the task runs for the block, is cancelled after it, and a
failure it met is raised when the block ends."""

from __future__ import annotations

import asyncio

import pytest

from rollq.schemas.tasks import beside


async def test_the_task_runs_for_the_block_and_is_cancelled_after() -> None:
    ticks: list[int] = []

    async def tick() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async with beside(tick(), name="ticking") as task:
        await asyncio.sleep(0.05)
        assert task.get_name() == "ticking" and not task.done()
    assert task.cancelled() and len(ticks) >= 2
    count = len(ticks)
    await asyncio.sleep(0.03)
    assert len(ticks) == count


async def test_a_failure_of_the_task_is_raised_when_the_block_ends() -> None:
    async def fail() -> None:
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        async with beside(fail()):
            await asyncio.sleep(0.01)


async def test_the_block_s_own_error_is_not_hidden() -> None:
    async def idle() -> None:
        await asyncio.sleep(10)

    with pytest.raises(ValueError, match="block"):
        async with beside(idle()) as task:
            raise ValueError("block")
    assert task.cancelled()
