"""Per-tenant metrics: counted only for requests that have a tenant, each tenant's series
made once; its requests in flight and queued read when scraped."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.observe.parts import AdmissionSeen
from narwhal.observe.tenant_metrics import REFUSAL_REASONS, TENANT_OUTCOMES, TenantMetrics
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call, Stage
from support.tenants import admission, tenant_router

TENANTS = [
    {"name": "search", "priority": 0, "weight": 3, "max_concurrent": 4},
    {"name": "batch", "priority": 2},
]


def call(status: int = 200, **fields: Any) -> Call:
    done = Call("r1", None, Endpoint.COMPLETIONS, arrival=10.0, deadline=20.0, **fields)
    done.status = status
    return done


def tenant_samples(text: bytes) -> dict[str, float]:
    """The `narwhal_tenant_*` samples: name plus sorted labels → value."""
    values = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.startswith("narwhal_tenant_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


async def test_a_router_without_tenants_exports_no_tenant_series() -> None:
    plain = tenant_router([])
    plain.metrics.observe(call(200, model="m", prompt_tokens=3, output_tokens=2), now=11.0)
    plain.metrics.observe(call(503, model="m", refusal="overload"), now=11.0)
    assert plain.admission is None
    assert tenant_samples(plain.metrics.render(None)[0]) == {}


async def test_a_call_without_a_tenant_never_reaches_the_tenant_series(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    the_router = tenant_router(TENANTS)

    def boom(self: TenantMetrics, call: Call, tenant: str) -> None:
        raise AssertionError("a call without a tenant reached the tenant series")

    monkeypatch.setattr(TenantMetrics, "observe", boom)
    the_router.metrics.observe(call(200, model="m", output_tokens=4), now=11.0)


async def test_each_configured_tenant_has_its_series_at_zero_from_the_start() -> None:
    values = tenant_samples(tenant_router(TENANTS).metrics.render(None)[0])
    for tenant in ("search", "batch"):
        for outcome in TENANT_OUTCOMES:
            requests = f"narwhal_tenant_requests_total{{outcome={outcome},tenant={tenant}}}"
            assert values[requests] == 0
        for reason in REFUSAL_REASONS:
            refusals = f"narwhal_tenant_refusals_total{{reason={reason},tenant={tenant}}}"
            assert values[refusals] == 0
        for kind in ("prompt", "output"):
            assert values[f"narwhal_tenant_tokens_total{{kind={kind},tenant={tenant}}}"] == 0
        assert values[f"narwhal_tenant_queue_wait_seconds_count{{tenant={tenant}}}"] == 0


async def test_a_tenants_requests_tokens_queue_wait_and_refusals_are_counted() -> None:
    the_router = tenant_router(TENANTS)
    metrics = the_router.metrics
    served = call(200, model="m", tenant="search", prompt_tokens=120, output_tokens=30)
    served.spent = {Stage.QUEUED: 0.25, Stage.PREFILL: 0.1}
    metrics.observe(served, now=11.0)
    metrics.observe(call(429, model="m", tenant="search", refusal="requests_per_minute"), 11.0)
    queued_out = call(503, model="m", tenant="batch", refusal="shed")
    queued_out.spent = {Stage.QUEUED: 2.0}
    metrics.observe(queued_out, now=12.0)
    # A tenant added at runtime (admin API, reload) and a reason not listed are counted too.
    metrics.observe(call(200, model="m", tenant="late", output_tokens=1), now=12.0)
    metrics.observe(call(503, model="m", tenant="batch", refusal="draining"), now=12.0)
    values = tenant_samples(metrics.render(None)[0])

    assert values["narwhal_tenant_requests_total{outcome=ok,tenant=search}"] == 1
    assert values["narwhal_tenant_requests_total{outcome=client_error,tenant=search}"] == 1
    assert values["narwhal_tenant_requests_total{outcome=error,tenant=batch}"] == 2
    assert values["narwhal_tenant_requests_total{outcome=ok,tenant=late}"] == 1
    assert values["narwhal_tenant_tokens_total{kind=prompt,tenant=search}"] == 120
    assert values["narwhal_tenant_tokens_total{kind=output,tenant=search}"] == 30
    assert values["narwhal_tenant_tokens_total{kind=output,tenant=late}"] == 1
    assert values["narwhal_tenant_refusals_total{reason=requests_per_minute,tenant=search}"] == 1
    assert values["narwhal_tenant_refusals_total{reason=shed,tenant=batch}"] == 1
    assert values["narwhal_tenant_refusals_total{reason=draining,tenant=batch}"] == 1
    assert values["narwhal_tenant_refusals_total{reason=max_concurrent,tenant=search}"] == 0
    # Only the requests that waited for seats: a refusal at admission never queued.
    assert values["narwhal_tenant_queue_wait_seconds_count{tenant=search}"] == 1
    assert values["narwhal_tenant_queue_wait_seconds_sum{tenant=search}"] == 0.25
    assert values["narwhal_tenant_queue_wait_seconds_bucket{le=0.25,tenant=search}"] == 1
    assert values["narwhal_tenant_queue_wait_seconds_bucket{le=0.1,tenant=search}"] == 0
    assert values["narwhal_tenant_queue_wait_seconds_sum{tenant=batch}"] == 2.0
    # Summed over tenants, the router's own requests series count the same requests.
    assert sum(v for k, v in values.items() if k.startswith("narwhal_tenant_requests_total{")) == 5
    # Each tenant's series are made once and kept.
    assert metrics.tenants.series("search") is metrics.tenants.series("search")


async def test_each_tenants_requests_in_flight_and_queued_are_read_when_scraped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    the_router = tenant_router(TENANTS)
    limits = admission(the_router).limits
    for _ in range(3):
        limits.admit("search", 10, time.monotonic())
    limits.admit("batch", 10, time.monotonic())
    # Waiting for seats, as the scheduler counts them ("": requests without a tenant; a
    # tenant removed at runtime still shows while it has requests queued).
    queued = {"search": 2, "": 5, "gone": 1}
    monkeypatch.setattr(the_router.fleet, "queued_by_tenant", lambda: queued)
    values = tenant_samples(the_router.metrics.render(None)[0])
    assert values["narwhal_tenant_requests_in_flight{tenant=search}"] == 3
    assert values["narwhal_tenant_requests_in_flight{tenant=batch}"] == 1
    assert values["narwhal_tenant_requests_queued{tenant=search}"] == 2
    assert values["narwhal_tenant_requests_queued{tenant=batch}"] == 0
    assert values["narwhal_tenant_requests_queued{tenant=gone}"] == 1
    assert "narwhal_tenant_requests_queued{tenant=}" not in values


def test_the_admission_is_what_the_observers_read() -> None:
    # Typed: the request path's admission gives the observers all they read of it.
    seen: AdmissionSeen = admission(tenant_router(TENANTS))
    assert set(seen.tenants) == {"search", "batch"}
