"""The soak's memory check: the router's resident memory must not trend upwards."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

WARM_UP_SHARE = 0.3


@dataclass(frozen=True, slots=True)
class Trend:
    """RSS after warm-up: where it started and ended, its fitted slope and the allowed growth."""

    start_mb: float
    end_mb: float
    slope_mb_per_min: float
    growth_mb: float
    bound_mb: float
    samples: int

    @property
    def stable(self) -> bool:
        return self.growth_mb <= self.bound_mb


def memory_trend(samples: Sequence[tuple[float, int]]) -> Trend:
    """Least-squares slope of RSS over time after the warm-up share of the samples.

    Growth is that slope over the measured span; it may be at most 16 MB or a tenth of the
    starting RSS, whichever is more, so noise passes and a per-request leak does not.
    """
    kept = samples[int(len(samples) * WARM_UP_SHARE) :]
    if len(kept) < 3:
        return Trend(0.0, 0.0, 0.0, 0.0, math.inf, len(kept))
    times = [t for t, _ in kept]
    sizes = [rss / 2**20 for _, rss in kept]
    mean_t, mean_s = sum(times) / len(times), sum(sizes) / len(sizes)
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(times, sizes, strict=True)) / spread
    growth = slope * (times[-1] - times[0])
    bound = max(16.0, sizes[0] / 10)
    return Trend(sizes[0], sizes[-1], slope * 60, growth, bound, len(kept))


def rss_bytes() -> int:
    """This process's resident set size (Linux `/proc`; elsewhere the peak, from rusage)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
