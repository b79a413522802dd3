"""The request journal: one JSON line per request, written off the event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path
from typing import Any

import orjson

_STOP = b""


class Journal:
    """Appends JSON lines from a writer thread, so a slow disk never stalls the router.

    `record()` only serialises and enqueues; a `None` path makes it a no-op.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("ab")
        self._thread = threading.Thread(
            target=self._write_loop, args=(handle,), name="narwhal-journal", daemon=True
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
        self._queue.put(orjson.dumps(entry) + b"\n")

    async def close(self) -> None:
        if self._thread is None:
            return
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _write_loop(self, handle: Any) -> None:
        with handle:
            while True:
                line = self._queue.get()
                if line == _STOP:
                    return
                handle.write(line)
                while not self._queue.empty():
                    line = self._queue.get()
                    if line == _STOP:
                        return
                    handle.write(line)
                handle.flush()
