"""A steady streaming load for tests that change the fleet while it serves, and a poll."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from support.stack import MODEL

# Generous: a shared 2-core machine may be slow at times; nothing here is timed.
WAIT_S = 90.0


@dataclass
class Load:
    """Steady streaming clients; each request's outcome, failures with their reason."""

    client: AsyncOpenAI
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def sent(self) -> int:
        return self.ok + len(self.failures)

    async def run(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                stream = await self.client.completions.create(
                    model=MODEL,
                    prompt=f"Client {index} asks about the tides, request {self.sent}",
                    max_tokens=12,
                    stream=True,
                )
                if not [chunk async for chunk in stream if chunk.choices]:
                    raise AssertionError("a stream with no tokens")
                self.ok += 1
            except Exception as error:  # every failure is recorded, none ends the load
                self.failures.append(f"{type(error).__name__}: {error}")

    async def more(self, count: int) -> None:
        """Wait until `count` more requests have succeeded (the load keeps running)."""
        target = self.ok + count
        await until(lambda: self.ok >= target, f"{count} more requests")


async def until(
    check: Callable[[], Awaitable[Any] | Any], what: str, timeout_s: float = WAIT_S
) -> Any:
    """Poll `check` until it returns something other than None or False, and return that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result not in (None, False):
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
