"""`[server] workers`: how many router processes serve one port.

`workers = 4` runs four; `"auto"` runs one per core the process may use: its CPU affinity
(which a container's cpuset narrows), and no more than its cgroup's CPU quota rounded up (a
Kubernetes CPU limit), resolved when the router starts rather than when the file is read,
so `narwhal config validate` on a laptop says `auto` and not the laptop's count.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from narwhal.config.table import Table

Workers = int | Literal["auto"]
# Beyond this, a typo (`workers = 400`) is likelier than a machine that wants it.
MAX_WORKERS = 256


def parse_workers(table: Table, key: str = "workers") -> Workers:
    """An integer in 1..MAX_WORKERS or `"auto"`; a problem is recorded under the key's path."""
    raw = table.take(key, required=False)
    if raw == "auto":
        return "auto"
    if isinstance(raw, str):
        table.fail(key, f'must be an integer from 1 to {MAX_WORKERS} or "auto", got "{raw}"')
        return 1
    return table.integer(key, 1, 1, MAX_WORKERS)


def parse_replicas(table: Table, key: str = "replicas") -> int:
    """How many router replicas share the fleet (each takes 1/replicas of every seat limit)."""
    return table.integer(key, 1, 1, MAX_WORKERS)


def conflict(workers: int, controller_enabled: bool) -> str | None:
    """Why a configuration cannot run with this many workers, or None.

    The role controller moves engines for one router process's view of the fleet; N
    processes each moving engines on their own evidence would fight.
    """
    if workers > 1 and controller_enabled:
        return (
            f"the role controller ([controller] enabled) runs in one router process; "
            f"{workers} workers asked: set server.workers = 1"
        )
    return None


def parse_workers_flag(text: str) -> Workers:
    """`--workers N|auto` on the command line, with the file's rules."""
    if text == "auto":
        return "auto"
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise ValueError(f"must be from 1 to {MAX_WORKERS} or auto, got {value}")
    return value


# cgroup v2's CPU quota of this process's group: "<quota> <period>" or "max <period>".
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def resolve_workers(setting: Workers) -> int:
    """The number of worker processes to run: `auto` is the cores this process may use."""
    if setting != "auto":
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota = quota_cores(CPU_MAX.read_text())
    except OSError:
        quota = None
    return max(1, min(cores, quota) if quota is not None else cores)


def quota_cores(cpu_max: str) -> int | None:
    """Cores a cgroup v2 `cpu.max` allows, rounded up; None without a quota."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return max(1, math.ceil(int(quota) / int(period)))
