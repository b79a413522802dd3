"""A Prometheus histogram observed on the event loop only: a bisect and two additions.

The client library's histogram takes a lock and walks its buckets for every value, which
the request path pays several times per request. These are observed by the one thread that
runs the event loop, and read by the scrape (on the same loop), so they need neither.
A labelled one (`LoopHistogramFamily`) keeps one such histogram per label values: the
caller looks a child up once and keeps it, so observing stays a bisect and two additions.
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
        return HistogramMetricFamily(
            self.name, self.documentation, buckets=self.cumulative(), sum_value=self._sum
        )

    def cumulative(self) -> list[tuple[str, float]]:
        """The exposition's buckets: (`le` bound, values at or under it), `+Inf` last."""
        buckets = []
        total = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            total += count
            buckets.append((_bound_label(bound), float(total)))
        buckets.append(("+Inf", float(total + self._counts[-1])))
        return buckets

    @property
    def sum(self) -> float:
        return self._sum


class LoopHistogramFamily:
    """Loop histograms of one name, one per label values, made on first use."""

    __slots__ = ("_buckets", "children", "documentation", "labelnames", "name")

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        labelnames: tuple[str, ...],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self._buckets = buckets
        self.labelnames = labelnames
        self.children: dict[tuple[str, ...], LoopHistogram] = {}

    def child(self, *values: str) -> LoopHistogram:
        """The histogram of these label values (in `labelnames`' order): look it up once
        and keep it, since this builds a key."""
        made = self.children.get(values)
        if made is None:
            made = self.children[values] = LoopHistogram(
                self.name, self.documentation, self._buckets
            )
        return made

    def family(self) -> HistogramMetricFamily:
        """Every child's buckets, count and sum under its labels."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, histogram in self.children.items():
            family.add_metric(list(values), histogram.cumulative(), histogram.sum)
        return family
