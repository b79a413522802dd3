"""Merging the workers' expositions: counters add up, engine facts are not multiplied."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from narwhal.workers.merge_metrics import Families, merge_expositions


def exposition(requests: int, in_flight: int, state: int, ttft: list[float]) -> str:
    registry = CollectorRegistry()
    Counter("narwhal_requests", "r", ["route"], registry=registry).labels("/v1/x").inc(requests)
    Gauge("narwhal_requests_in_flight", "f", registry=registry).set(in_flight)
    Gauge("narwhal_engine_state", "s", ["engine"], registry=registry).labels("d0").set(state)
    histogram = Histogram("narwhal_ttft_seconds", "t", buckets=(0.1, 1.0), registry=registry)
    for value in ttft:
        histogram.observe(value)
    return generate_latest(registry).decode()


def samples(texts: list[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in merge_expositions(texts)
        for sample in family.samples
    }


def test_counters_histograms_and_additive_gauges_are_summed() -> None:
    merged = samples([exposition(3, 2, 1, [0.05]), exposition(4, 5, 1, [0.5, 2.0])])
    assert merged[("narwhal_requests_total", (("route", "/v1/x"),))] == 7
    assert merged[("narwhal_requests_in_flight", ())] == 7
    assert merged[("narwhal_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("narwhal_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("narwhal_ttft_seconds_count", ())] == 3
    assert merged[("narwhal_ttft_seconds_sum", ())] == 2.55


def test_a_fact_every_worker_sees_is_not_multiplied() -> None:
    merged = samples([exposition(0, 0, 1, []), exposition(0, 0, 0, [])])
    # An engine state gauge is 1 when any worker holds the engine in that state.
    assert merged[("narwhal_engine_state", (("engine", "d0"),))] == 1


def test_a_counters_start_is_the_oldest_workers() -> None:
    first, second = exposition(1, 0, 0, []), exposition(1, 0, 0, [])
    key = ("narwhal_requests_created", (("route", "/v1/x"),))
    assert samples([first])[key] < samples([second])[key]
    assert samples([second, first])[key] == samples([first])[key]


def test_the_merge_encodes_as_an_exposition_again() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(merge_expositions([exposition(2, 1, 1, [0.2])] * 2)))
    text = generate_latest(registry).decode()
    assert 'narwhal_requests_total{route="/v1/x"} 4.0' in text
    assert "narwhal_requests_in_flight 2.0" in text


def test_a_dead_workers_counts_stay_and_its_gauges_go() -> None:
    live, dead = exposition(3, 2, 0, [0.05]), exposition(4, 5, 1, [0.5])
    merged = samples_with_retired([live], [dead])
    assert merged[("narwhal_requests_total", (("route", "/v1/x"),))] == 7
    assert merged[("narwhal_ttft_seconds_count", ())] == 2
    assert merged[("narwhal_requests_in_flight", ())] == 2
    assert merged[("narwhal_engine_state", (("engine", "d0"),))] == 0


def samples_with_retired(
    texts: list[str], retired: list[str]
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in merge_expositions(texts, retired)
        for sample in family.samples
    }
