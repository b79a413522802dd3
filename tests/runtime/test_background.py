"""The one task group behind every background task: what `spawn` starts, `stop` ends."""

from __future__ import annotations

import asyncio
import logging

import pytest

from narwhal.runtime.background import Background


async def test_stop_cancels_every_task_and_waits_for_each() -> None:
    background = Background()
    await background.start()
    ended: list[str] = []

    async def loop(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    tasks = [background.spawn(loop(name), name) for name in ("a", "b")]
    await asyncio.sleep(0)
    assert background.running == 2
    await background.stop()
    assert sorted(ended) == ["a", "b"]
    assert all(task is not None and task.done() for task in tasks)
    assert background.running == 0


async def test_a_failing_task_is_logged_and_ends_alone(caplog: pytest.LogCaptureFixture) -> None:
    background = Background()
    await background.start()
    still = asyncio.Event()

    async def broken() -> None:
        raise RuntimeError("boom")

    async def steady() -> None:
        await asyncio.sleep(0.05)
        still.set()

    with caplog.at_level(logging.ERROR, logger="narwhal.background"):
        background.spawn(broken(), "broken")
        background.spawn(steady(), "steady")
        async with asyncio.timeout(30):
            await still.wait()
    assert "background task broken failed" in caplog.text
    await background.stop()


async def test_nothing_starts_once_stopped() -> None:
    background = Background()
    await background.start()
    await background.stop()
    ran: list[int] = []

    async def late() -> None:
        ran.append(1)

    assert background.spawn(late(), "late") is None
    await asyncio.sleep(0)
    assert ran == []
