"""IdleTimeout: idle and total deadlines, progress, outside cancellation."""

from __future__ import annotations

import asyncio

import pytest

from tailguard.gateway.idle import IdleTimeout


def test_fires_after_idle_without_progress() -> None:
    async def body() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with IdleTimeout(loop, 0.05, t0 + 10):
                await asyncio.sleep(5)
        return loop.time() - t0

    assert 0.04 <= asyncio.run(body()) < 1.0


def test_progress_keeps_it_alive_until_the_total_deadline() -> None:
    async def body() -> tuple[int, float, bool]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ticks = 0
        with pytest.raises(TimeoutError):
            async with IdleTimeout(loop, 0.2, t0 + 0.8) as idle:
                while True:
                    await asyncio.sleep(0.02)  # progress well within the idle time
                    ticks += 1
                    idle.touch()
        return ticks, loop.time() - t0, idle.expired

    ticks, took, expired = asyncio.run(body())
    assert expired and ticks >= 15  # outlived several idle periods
    assert 0.78 <= took < 2.0  # and stopped at the total deadline


def test_finishing_in_time_raises_nothing_and_disarms() -> None:
    async def body() -> bool:
        loop = asyncio.get_running_loop()
        async with IdleTimeout(loop, 0.05, loop.time() + 10) as idle:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # past the idle time: nothing fires any more
        return idle.expired

    assert asyncio.run(body()) is False


def test_outside_cancellation_stays_a_cancellation() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()

        async def worker() -> None:
            async with IdleTimeout(loop, 5.0, loop.time() + 10):
                await asyncio.sleep(5)

        task = asyncio.ensure_future(worker())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
