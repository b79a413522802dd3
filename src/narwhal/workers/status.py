"""The supervisor's record of its workers, in a file of the run directory the workers read.

The supervisor rewrites it (atomically, by rename) whenever a worker starts or exits; a
worker answering `/narwhal/state` or `/metrics` for the whole router reads it for the
restart counts. Also where each worker's Unix socket lives.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

STATUS_FILE = "supervisor.json"


def peer_socket(run_dir: Path, worker: int) -> Path:
    """Where worker `worker` answers its peers (and the supervisor's readiness check)."""
    return run_dir / f"worker-{worker}.sock"


@dataclass(slots=True)
class SlotStatus:
    """One worker slot: the process now in it, and what happened to the ones before."""

    worker: int
    pid: int | None = None
    started: float | None = None
    restarts: int = 0
    # The last exit: its code, or minus the signal that ended it.
    last_exit: int | None = None
    # Requests the workers that exited were serving when they did (see `ledger`).
    lost: int = 0


def write_status(run_dir: Path, supervisor_pid: int, slots: list[SlotStatus]) -> None:
    body = {"supervisor_pid": supervisor_pid, "slots": [asdict(slot) for slot in slots]}
    temporary = run_dir / (STATUS_FILE + ".tmp")
    temporary.write_bytes(orjson.dumps(body))
    os.replace(temporary, run_dir / STATUS_FILE)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The last status written, or None before the first."""
    try:
        status: dict[str, Any] = orjson.loads((run_dir / STATUS_FILE).read_bytes())
    except FileNotFoundError:
        return None
    return status
