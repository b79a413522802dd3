"""The owner of every task that outlives a request: one `asyncio.TaskGroup`, from start to stop.

The process's loops (readmission, engine reports, the role controller, discovery, KV event
feeds, the event-loop lag watch) and the short jobs a request leaves behind (the release
of an abandoned handoff) are all started through `Background.spawn`, so that stopping
the router ends every one of them and waits for each. A task that fails is logged and
ends alone: one broken loop does not take the others, or the requests, down with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("narwhal.background")

# Starts a background task (a coroutine and the task's name); None when the owner has
# stopped, in which case the coroutine is closed unrun.
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None] | None"]


class Background:
    """One task group holding every background task; `spawn` adds to it."""

    def __init__(self) -> None:
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._owner: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()

    async def start(self) -> None:
        """Open the group; it stays open, in a task of its own, until `stop`."""
        self._owner = asyncio.get_running_loop().create_task(self._own(), name="background")
        await self._ready.wait()

    async def _own(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._ready.set()
            await self._stopping.wait()
            self._group = None
            for task in self._tasks:
                task.cancel()

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
        if self._group is None:
            coroutine.close()
            return None
        task = self._group.create_task(_logged(coroutine, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancel every task and wait until each has ended."""
        self._stopping.set()
        if self._owner is not None:
            await self._owner
            self._owner = None

    @property
    def running(self) -> int:
        return len(self._tasks)


async def _logged(coroutine: Coroutine[Any, Any, None], name: str) -> None:
    try:
        await coroutine
    except Exception:
        log.exception("background task %s failed", name)
