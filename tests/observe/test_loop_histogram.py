"""A loop histogram exposes exactly what the client library's histogram does for the same
values (bar the `_created` series), bounds included."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from narwhal.observe.loop_histogram import LoopHistogram, LoopHistogramFamily
from narwhal.observe.metrics import DURATION_BUCKETS, LATENCY_BUCKETS


class _One(Collector):
    def __init__(self, histogram: LoopHistogram) -> None:
        self.histogram = histogram

    def collect(self) -> Iterator[Metric]:
        yield self.histogram.family()


def exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@given(
    st.sampled_from([LATENCY_BUCKETS, DURATION_BUCKETS]),
    st.lists(
        st.floats(min_value=0, max_value=1000, allow_nan=False)
        | st.sampled_from([*LATENCY_BUCKETS, *DURATION_BUCKETS]),
        max_size=30,
    ),
)
def test_the_exposition_is_the_client_librarys_for_the_same_values(
    buckets: tuple[float, ...], values: list[float]
) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "help", buckets=buckets, registry=theirs)
    mine = LoopHistogram("h_seconds", "help", buckets)
    ours.register(_One(mine))
    for value in values:
        reference.observe(value)
        mine.observe(value)
    assert exposition(ours) == exposition(theirs)


class _Family(Collector):
    def __init__(self, family: LoopHistogramFamily) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family.family()


@given(
    st.lists(
        st.tuples(
            st.sampled_from([("a", ""), ("a", "sql"), ("b", "")]),
            st.floats(min_value=0, max_value=1000, allow_nan=False),
        ),
        max_size=30,
    )
)
def test_a_labelled_family_is_the_client_librarys_labelled_histogram(
    values: list[tuple[tuple[str, str], float]],
) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ("model", "adapter")
    reference = Histogram("h_seconds", "help", labels, buckets=LATENCY_BUCKETS, registry=theirs)
    mine = LoopHistogramFamily("h_seconds", "help", LATENCY_BUCKETS, labels)
    ours.register(_Family(mine))
    for pair, value in values:
        reference.labels(*pair).observe(value)
        mine.child(*pair).observe(value)
    assert exposition(ours) == exposition(theirs)
    for pair, _ in values:
        assert mine.child(*pair) is mine.child(*pair)
