"""A bucketed count of the gaps between decode stream reads.

Decode streams update it once per transport read, so it is kept as small as a histogram
can be: one `bisect` and two additions, about a sixth of a `prometheus_client` observation.
The router's metrics read the buckets when they are scraped.
"""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds in seconds; typical decode steps take 10-50 ms, a stall takes seconds.
GAP_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TokenGaps:
    """Counts per bucket (`counts[i]` holds gaps up to `bounds[i]`; the last is +Inf)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = GAP_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, gap: float) -> None:
        self.counts[bisect_left(self.bounds, gap)] += 1
        self.total += gap

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus-style buckets: (upper bound, count of gaps at or below it)."""
        running, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return buckets
