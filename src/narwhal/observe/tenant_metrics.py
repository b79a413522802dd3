"""Per-tenant Prometheus metrics, with `[[tenants]]`.

A request that has a tenant counts into its tenant's series once, when it ends: requests
by outcome, tokens by kind, its queue wait, and its refusal by reason. Each tenant's series
are made once and kept (`TenantSeries`), every configured tenant's at the start (zeros
included, so that `increase()` sees its first request and first refusal of each reason);
a request costs a dict lookup and its increments. A request without a tenant never gets
here: `RouterMetrics.observe` tests `call.tenant is None` and moves on.

At scrape time, each tenant's requests in flight and queued in this process are read from
the admission and the fleet (`--workers N` sums the workers').

Every label value comes from a bounded set: tenant names from the configuration (or the
admin API), the outcomes, token kinds and refusal reasons below.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from narwhal.observe.loop_histogram import LoopHistogramFamily

if TYPE_CHECKING:
    from narwhal.observe.parts import Observed
    from narwhal.router.call import Call

# A tenant's requests by outcome (`router.call.outcome_of`).
TENANT_OUTCOMES = ("ok", "client_error", "timeout", "error", "client_closed")
# Why a request was refused with 429 or 503 (`Call.refusal`): the tenant's own limits, then
# the fleet's. A reason not listed here is counted all the same, from its first refusal.
REFUSAL_REASONS = (
    "max_concurrent",
    "requests_per_minute",
    "tokens_per_minute",
    "request_too_large",
    "max_queued",
    "overload",
    "shed",
    "queue_full",
)
TOKEN_KINDS = ("prompt", "output")


class TenantSeries:
    """One tenant's request series, looked up once and kept."""

    __slots__ = (
        "_metrics",
        "name",
        "outcomes",
        "output_tokens",
        "prompt_tokens",
        "queue_wait",
        "refusals",
    )

    def __init__(self, metrics: TenantMetrics, name: str) -> None:
        self._metrics = metrics
        self.name = name
        self.outcomes = {o: metrics.requests.labels(name, o) for o in TENANT_OUTCOMES}
        self.prompt_tokens = metrics.tokens.labels(name, "prompt")
        self.output_tokens = metrics.tokens.labels(name, "output")
        self.queue_wait = metrics.queue_wait.child(name)
        self.refusals = {r: metrics.refusals.labels(name, r) for r in REFUSAL_REASONS}

    def observe(self, call: Call) -> None:
        """Count one finished request of this tenant."""
        outcome = call.outcome
        requests = self.outcomes.get(outcome)
        if requests is None:
            requests = self.outcomes[outcome] = self._metrics.requests.labels(self.name, outcome)
        requests.inc()
        if call.prompt_tokens:
            self.prompt_tokens.inc(call.prompt_tokens)
        if call.output_tokens:
            self.output_tokens.inc(call.output_tokens)
        wait = call.queue_wait_s
        if wait is not None:
            self.queue_wait.observe(wait)
        reason = call.refusal
        if reason is not None:
            refusals = self.refusals.get(reason)
            if refusals is None:
                refusals = self.refusals[reason] = self._metrics.refusals.labels(self.name, reason)
            refusals.inc()


class TenantMetrics:
    """The per-tenant families in a router's registry, and each tenant's kept series."""

    def __init__(
        self, registry: CollectorRegistry, router: Observed, buckets: tuple[float, ...]
    ) -> None:
        """`buckets`: the queue wait's, as the router-wide `narwhal_queue_wait_seconds`."""
        self.requests = Counter(
            "narwhal_tenant_requests",
            "Finished client requests of each tenant, by outcome.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "narwhal_tenant_tokens",
            "Tokens of each tenant's requests as the engines reported them, by kind: "
            "prompt or output.",
            ["tenant", "kind"],
            registry=registry,
        )
        # Observed on the event loop; the caller's collector of loop histograms reads it.
        self.queue_wait = LoopHistogramFamily(
            "narwhal_tenant_queue_wait_seconds",
            "Time each tenant's requests spent waiting for seats, summed over attempts.",
            buckets,
            ("tenant",),
        )
        self.refusals = Counter(
            "narwhal_tenant_refusals",
            "Each tenant's requests refused with 429 or 503, by reason: its own limits "
            "(max_concurrent, requests_per_minute, tokens_per_minute, request_too_large, "
            "max_queued) or the "
            "fleet's (overload, shed, queue_full).",
            ["tenant", "reason"],
            registry=registry,
        )
        registry.register(_TenantGauges(router))
        self._by_tenant: dict[str, TenantSeries] = {}
        # Every configured tenant's series from the start; one added at runtime gets its
        # with its first request.
        for tenant in router.config.tenants:
            self.series(tenant.name)

    def series(self, name: str) -> TenantSeries:
        """The request series of tenant `name`, made on first use."""
        made = self._by_tenant.get(name)
        if made is None:
            made = self._by_tenant[name] = TenantSeries(self, name)
        return made

    def observe(self, call: Call, tenant: str) -> None:
        """Record one finished request of `tenant` (its `call.tenant`)."""
        series = self._by_tenant.get(tenant)
        if series is None:
            series = self.series(tenant)
        series.observe(call)


class _TenantGauges(Collector):
    """Per tenant, read when scraped (nothing without tenants): its requests in flight in
    this process, queued ones included, and those waiting for a seat here."""

    def __init__(self, router: Observed) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        admission = self.router.admission
        if admission is None:
            return
        state = admission.limits.state(time.monotonic())
        queued = self.router.fleet.queued_by_tenant()
        in_flight = GaugeMetricFamily(
            "narwhal_tenant_requests_in_flight",
            "Each tenant's requests between admission and end, queued ones included.",
            labels=["tenant"],
        )
        waiting = GaugeMetricFamily(
            "narwhal_tenant_requests_queued",
            "Each tenant's requests waiting for a seat.",
            labels=["tenant"],
        )
        # A tenant removed at runtime shows while it still has requests queued ("": none).
        for name in dict.fromkeys([*admission.tenants, *(name for name in queued if name)]):
            held = state.get(name) or {}
            in_flight.add_metric([name], held.get("in_flight_here") or 0)
            waiting.add_metric([name], queued.get(name, 0))
        yield from (in_flight, waiting)
