"""The request journal: one JSON line per request, written off the event loop.

Lines are appended with `O_APPEND` and whole: each write(2) carries only complete lines, so
several processes (the workers of one router) can share one file without a line of one
cutting into a line of another.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

_STOP = b""


class Journal:
    """Appends JSON lines from a writer thread, so a slow disk never stalls the router.

    `record()` only serialises and enqueues; a `None` path makes it a no-op. `stamp` is
    added to every line (a worker's number).
    """

    def __init__(self, path: Path | None, stamp: Mapping[str, object] | None = None) -> None:
        self.path = path
        self.stamp = dict(stamp or {})
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._thread = threading.Thread(
            target=self._write_loop, args=(fd,), name="narwhal-journal", daemon=True
        )
        self._thread.start()

    @property
    def writing(self) -> bool:
        """Whether lines are being written: callers may skip building an entry when not."""
        return self._thread is not None

    def record(self, entry: dict[str, Any]) -> None:
        if self._thread is None:
            return
        entry.setdefault("ts", time.time())
        for key, value in self.stamp.items():
            entry.setdefault(key, value)
        self._queue.put(orjson.dumps(entry) + b"\n")

    async def close(self) -> None:
        if self._thread is None:
            return
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _write_loop(self, fd: int) -> None:
        try:
            while True:
                batch = [self._queue.get()]
                while batch[-1] != _STOP and not self._queue.empty():
                    batch.append(self._queue.get())
                stopping = batch[-1] == _STOP
                _write_all(fd, b"".join(batch))
                if stopping:
                    return
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """One write(2) for the batch; a short write (a full disk) continues where it stopped."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
