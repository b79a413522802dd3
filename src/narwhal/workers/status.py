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


def metrics_snapshot(run_dir: Path, worker: int) -> Path:
    """A worker's own metrics, rewritten every `SNAPSHOT_S` (kept for when it dies)."""
    return run_dir / f"worker-{worker}.prom"


def retired_snapshots(run_dir: Path) -> Path:
    """Where the supervisor keeps the last snapshot of each worker that died."""
    return run_dir / "retired"


def retire_snapshot(run_dir: Path, worker: int, pid: int) -> None:
    """Keep a dead worker's last snapshot, so that its counts stay in the router's."""
    snapshot = metrics_snapshot(run_dir, worker)
    if snapshot.exists():
        retired_snapshots(run_dir).mkdir(exist_ok=True)
        os.replace(snapshot, retired_snapshots(run_dir) / f"worker-{worker}-{pid}.prom")


def read_retired(run_dir: Path) -> dict[int, list[str]]:
    """Dead workers' last snapshots, by worker number."""
    found: dict[int, list[str]] = {}
    folder = retired_snapshots(run_dir)
    for path in sorted(folder.glob("worker-*.prom")) if folder.exists() else ():
        worker = int(path.name.split("-")[1])
        found.setdefault(worker, []).append(path.read_text())
    return found


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
    """Replace the status file whole, so a reader never sees half of one."""
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
