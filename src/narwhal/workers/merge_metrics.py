"""One `/metrics` for the whole router out of each worker's own exposition.

Each worker keeps its own registry; a scrape gathers every worker's text and merges it
here, sample by sample (same name, same labels):

| family                                   | merged as                                       |
|------------------------------------------|-------------------------------------------------|
| counter, histogram, summary, untyped     | sum (each worker counted its own requests)      |
| `*_created` (a counter's start time)     | min (the oldest worker's start)                 |
| gauge in `ADDITIVE_GAUGES`               | sum (requests, seats, legs each worker holds)   |
| any other gauge (engine standing, limits,| max: the same fact seen by each worker; an      |
|   the engine's own reported load)        |   engine-state gauge is 1 if any worker sees it |

A worker that died leaves its last snapshot (see `child`): its counters and histograms
are added as `retired` texts, so that the router's counters never go back when a worker is
replaced (losing at most the last snapshot interval's counts); its gauges are not, since
nothing it held is held any more.

Pure: texts in, metric families out.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Gauges that count what each worker holds: the router's figure is their sum.
ADDITIVE_GAUGES = frozenset(
    {
        "narwhal_requests_in_flight",
        "narwhal_requests_queued",
        "narwhal_open_engine_legs",
        "narwhal_retry_budget_credit",
        "narwhal_engine_seats_in_use",
        "narwhal_engine_abandoned_pinned_blocks",
        # Each worker's own (`observe.tenant_metrics`), not the shared store's count.
        "narwhal_tenant_requests_in_flight",
        "narwhal_tenant_requests_queued",
    }
)

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def merge_expositions(texts: Sequence[str], retired: Sequence[str] = ()) -> list[Metric]:
    """The merged families, in the order each first appears; `retired`: dead workers' last
    snapshots, whose counts go on counting."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, float]] = {}
    for text, live in [(text, True) for text in texts] + [(text, False) for text in retired]:
        for family in text_string_to_metric_families(text):
            if not live and family.type == "gauge":
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            combine = _combiner(family)
            seen = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = seen.get(key)
                seen[key] = sample.value if before is None else combine(before, sample.value)
    for name, family in families.items():
        family.samples = [
            Sample(sample, dict(labels), value) for (sample, labels), value in values[name].items()
        ]
    return list(families.values())


def sample_total(text: str, sample: str) -> float:
    """The sum of one sample name's values over its labels, in one exposition."""
    return sum(
        each.value
        for family in text_string_to_metric_families(text)
        for each in family.samples
        if each.name == sample
    )


def _combiner(family: Metric) -> Callable[[float, float], float]:
    if family.name.endswith("_created"):
        return min
    if family.type == "gauge" and family.name not in ADDITIVE_GAUGES:
        return max
    return operator.add


class Families(Collector):
    """Already-built families as a collector, so the usual encoders can write them."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
