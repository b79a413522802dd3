"""A Prometheus histogram observed on the event loop only: a bisect and two additions.

The client library's histogram takes a lock and walks its buckets for every value, which
the request path pays several times per request. These are observed by the one thread that
runs the event loop, and read by the scrape (on the same loop), so they need neither.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import cast

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# The client library's spelling of a bound (`le="0.25"`), which it leaves untyped.
_bound_label = cast(Callable[[float], str], floatToGoString)


class LoopHistogram:
    """Counts per bucket (`le` bounds, values equal to a bound counted in it) and a sum."""

    __slots__ = ("_bounds", "_counts", "_sum", "documentation", "name")

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(sorted(buckets))
        # One more count than bounds: values past the last bound (`+Inf`).
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def family(self) -> HistogramMetricFamily:
        """The histogram as the exposition shows it: cumulative buckets, count and sum."""
        buckets = []
        total = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            total += count
            buckets.append((_bound_label(bound), float(total)))
        buckets.append(("+Inf", float(total + self._counts[-1])))
        return HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=self._sum
        )
