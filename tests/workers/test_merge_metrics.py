"""Merging the workers' expositions: counters add up, engine facts are not multiplied."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call, Stage
from narwhal.workers.merge_metrics import Families, merge_expositions
from support.tenants import admission, tenant_router


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


async def test_the_tenant_series_of_every_worker_add_up() -> None:
    workers = [tenant_router([{"name": "search", "max_concurrent": 8}]) for _ in range(2)]
    for held, router in zip((1, 2), workers, strict=True):
        served = Call("r", None, Endpoint.COMPLETIONS, 10.0, 20.0, tenant="search")
        served.status, served.output_tokens = 200, 5
        served.spent = {Stage.QUEUED: 0.05 * held}
        router.metrics.observe(served, now=11.0)
        for _ in range(held):
            admission(router).limits.admit("search", 10, time.monotonic())
    # Each worker's limits here are its own store; in a router they share one, and each
    # worker still shows only its own requests, so that the sum is the router's.
    merged = samples([router.metrics.render(None)[0].decode() for router in workers])
    search = (("tenant", "search"),)
    assert merged[("narwhal_tenant_requests_total", (("outcome", "ok"), *search))] == 2
    assert merged[("narwhal_tenant_tokens_total", (("kind", "output"), *search))] == 10
    assert merged[("narwhal_tenant_queue_wait_seconds_count", search)] == 2
    assert merged[("narwhal_tenant_queue_wait_seconds_sum", search)] == pytest.approx(0.15)
    assert merged[("narwhal_tenant_requests_in_flight", search)] == 3
    assert merged[("narwhal_tenant_requests_queued", search)] == 0
