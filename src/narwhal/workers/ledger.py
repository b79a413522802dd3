"""A worker's ledger: the requests it is serving, on disk as they arrive and end.

A worker killed outright writes no journal line for the requests it was serving. Its
ledger, kept in the run directory (on tmpfs where there is one), lets the supervisor write
one for each: every request is recorded even when its worker is not there to do it. Lines
are written synchronously, in the request's own step, so the ledger is exact at any instant
a process can be killed; when it grows past `COMPACT_BYTES` it is rewritten with only the
requests still open.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from narwhal.router.call import Call

COMPACT_BYTES = 1 << 20


def ledger_path(run_dir: Path, worker: int) -> Path:
    """Where worker `worker` keeps its ledger."""
    return run_dir / f"worker-{worker}.ledger"


class Ledger:
    """`opened` and `closed` are the router's arrival and finish hooks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open: dict[str, bytes] = {}
        self._size = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def opened(self, call: Call) -> None:
        """A request arrived: on disk before anything about it can fail."""
        line = orjson.dumps(
            {
                "open": call.request_id,
                "client_request_id": call.client_request_id,
                "endpoint": call.endpoint.value,
                "ts": time.time(),
            }
        )
        self._open[call.request_id] = line + b"\n"
        self._write(self._open[call.request_id])

    def closed(self, call: Call, now: float) -> None:
        """A request ended, its journal line queued: the journal records it from now on."""
        if self._open.pop(call.request_id, None) is None:
            return
        self._write(orjson.dumps({"close": call.request_id}) + b"\n")
        if self._size > COMPACT_BYTES:
            self._compact()

    def close(self) -> None:
        os.close(self._fd)

    def _write(self, data: bytes) -> None:
        self._size += os.write(self._fd, data)

    def _compact(self) -> None:
        fresh = self.path.with_suffix(".compacting")
        body = b"".join(self._open.values())
        fresh.write_bytes(body)
        os.replace(fresh, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = len(body)


def unfinished(path: Path) -> list[dict[str, Any]]:
    """The requests a ledger shows opened and never closed, oldest first (none if absent).

    A last line cut short by the kill is skipped.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    open_requests: dict[str, dict[str, Any]] = {}
    for line in raw.split(b"\n"):
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if "open" in entry:
            open_requests[entry["open"]] = entry
        elif "close" in entry:
            open_requests.pop(entry["close"], None)
    return list(open_requests.values())
