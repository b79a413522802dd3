"""The bench's core cap (`narwhal bench --workers N --core-cap F`) really holds a process to
its share of a core, and leaves nothing behind. Needs a writable cpu cgroup (root)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_procs import cpu_seconds
from core_cap import CoreCap

BUSY = "while True: pass"


def _cap_or_skip(fraction: float) -> CoreCap:
    try:
        return CoreCap(fraction)
    except RuntimeError as error:
        pytest.skip(str(error))


def test_a_capped_busy_loop_gets_at_most_its_share() -> None:
    cap = _cap_or_skip(0.2)
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        cap.cap(busy.pid)
        start_cpu, start = cpu_seconds(busy.pid), time.monotonic()
        time.sleep(2.0)
        used = (cpu_seconds(busy.pid) - start_cpu) / (time.monotonic() - start)
        # Uncapped it would take a whole core (less on a busy machine, never more than 0.2
        # capped); clock ticks round, so allow a little over.
        assert used <= 0.3, f"a process capped at 0.2 of a core used {used:.2f}"
        # Held back by the cap, unless a machine this busy never gave it even its share.
        assert cap.throttled_s() > 0 or used < 0.15, "a busy loop under a cap is held back"
    finally:
        busy.kill()
        busy.wait()
        cap.close()


def test_closing_removes_the_groups() -> None:
    cap = _cap_or_skip(0.5)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cap.cap(sleeper.pid)
        groups = list(cap._groups)
        assert all(group.is_dir() for group in groups)
        assert str(sleeper.pid) in Path(groups[0], "cgroup.procs").read_text().split()
    finally:
        cap.close()
        sleeper.kill()
        sleeper.wait()
    assert not any(group.exists() for group in groups)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_cap_is_a_fraction_of_one_core(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction of one core"):
        CoreCap(fraction)
