"""A CPU cap for one process, so that a router can be made the bottleneck of a bench run.

On a small machine the engines and the load generator share the router's cores, so a router
never runs out of CPU before they do and its throughput ceiling cannot show. A cap gives each
router process at most a fixed fraction of one core (a CFS bandwidth quota in a cgroup of its
own), leaving the rest to everything else: one process then relays at most what that
fraction allows, and N workers, each capped alike, at most N times that. Needs a writable cpu
cgroup (v1 `cpu` or v2 `unified` with the cpu controller), as root.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

PERIOD_US = 10_000
"""A short period, so that a capped process waits at most a few ms when it is throttled."""

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_NUMBERS = itertools.count()


class CoreCap:
    """Cgroups made by this bench, one per capped process, removed by `close`."""

    def __init__(self, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"a core cap is a fraction of one core in (0, 1], not {fraction}")
        self.fraction = fraction
        self._groups: list[Path] = []
        self._root, self._v2 = _root()

    def cap(self, pid: int) -> None:
        """Move `pid` (all its threads) into a new cgroup limited to `fraction` of a core."""
        group = self._root / f"narwhal-bench-{os.getpid()}-{next(_NUMBERS)}"
        group.mkdir()
        self._groups.append(group)
        quota = max(1000, round(self.fraction * PERIOD_US))
        if self._v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds the capped processes spent throttled, summed: the cap was what held them."""
        total = 0.0
        for group in self._groups:
            with contextlib.suppress(OSError):
                for line in (group / "cpu.stat").read_text().splitlines():
                    key, value = line.split()
                    if key == "throttled_time":  # v1: ns
                        total += int(value) / 1e9
                    elif key == "throttled_usec":  # v2
                        total += int(value) / 1e6
        return total

    def close(self) -> None:
        """Move what is left back to the root group and remove the groups."""
        for group in self._groups:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (self._root / "cgroup.procs").write_text(pid)
                group.rmdir()
        self._groups.clear()


def _root() -> tuple[Path, bool]:
    if (_V1 / "cpu.cfs_quota_us").exists() and os.access(_V1, os.W_OK):
        return _V1, False
    for root in (_V2, _V2 / "unified"):
        controllers = root / "cgroup.subtree_control"
        if controllers.exists() and os.access(root, os.W_OK):
            if "cpu" not in controllers.read_text().split():
                with contextlib.suppress(OSError):
                    controllers.write_text("+cpu")
            if "cpu" in controllers.read_text().split():
                return root, True
    raise RuntimeError(
        "--core-cap needs a writable cpu cgroup (/sys/fs/cgroup/cpu or cgroup v2 with the "
        "cpu controller), as root"
    )
