"""Prometheus metrics for one router, in a registry of its own.

Request metrics are observed once per request, from its finished `Call`. What the router
already keeps (engine standing, seats, the retry budget, decode gaps) is read when
`/metrics` is scraped, so it costs the request path nothing. Every label value comes from
a bounded set: routes, outcomes, statuses, causes, defects, engine ids, and the base models
and adapters the fleet's catalog knows (a request naming anything else is refused before
it has a `model`, and counts under `model=""`).

The per-request series carry `model` (the pool's base model) and `adapter` (its LoRA
adapter, "" for the base weights). Each (model, adapter) pair's series are made the first
time it is seen and kept (`ModelSeries`), so a request costs two dict lookups more than
an unlabelled series would, and nothing is built for it.

With `[[tenants]]`, a request that has a tenant also counts into its tenant's series
(`observe.tenant_metrics`); one without (every request, without tenants) pays one
`is None` test for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from narwhal.config.engine_spec import Role
from narwhal.control.controller import MOVE_REASONS
from narwhal.engines.handoff import DescriptorRejected
from narwhal.fleet.table import EngineState, Phase
from narwhal.observe.loop_histogram import LoopHistogram, LoopHistogramFamily
from narwhal.observe.tenant_metrics import TenantMetrics
from narwhal.protocol.errors import Cause
from narwhal.router.call import outcome_of
from narwhal.runtime.background import Spawn

if TYPE_CHECKING:
    from narwhal.control.loop import ControlLoop
    from narwhal.observe.parts import Observed
    from narwhal.router.call import Call

# Seconds. Time to first token spans a cached 20 ms prefill to a queued long prompt.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LAG_INTERVAL_S = 0.5
# Causes that name an engine fault; each engine exports all of them, zeros included, so
# that `increase()` sees an engine's first failure of a kind.
ENGINE_CAUSES = tuple(
    c.value for c in Cause if c not in (Cause.BAD_REQUEST, Cause.UNAVAILABLE, Cause.DEADLINE)
)
PROBE_RESULTS = ("success", "failure", "inconclusive")
# The labels every per-request series adds: the base model, and the adapter ("" for none).
MODEL_LABELS = ("model", "adapter")


class ModelSeries:
    """One (model, adapter) pair's request series, looked up once and kept."""

    __slots__ = (
        "_metrics",
        "adapter",
        "attempts",
        "decode",
        "duration",
        "first_byte",
        "handoff_gap",
        "model",
        "output_tokens",
        "prefill",
        "queue_wait",
        "requests",
        "ttft",
    )

    def __init__(self, metrics: RouterMetrics, model: str, adapter: str) -> None:
        self._metrics = metrics
        self.model, self.adapter = model, adapter
        self.ttft = metrics.ttft.child(model, adapter)
        self.first_byte = metrics.first_byte.child(model, adapter)
        self.handoff_gap = metrics.handoff_gap.child(model, adapter)
        self.duration = metrics.duration.child(model, adapter)
        self.queue_wait = metrics.queue_wait.child(model, adapter)
        self.prefill = metrics.prefill.child(model, adapter)
        self.decode = metrics.decode.child(model, adapter)
        self.attempts = metrics.attempts.labels(model, adapter)
        self.output_tokens = metrics.output_tokens.labels(model, adapter)
        # By (route, status): the statuses are few.
        self.requests: dict[tuple[str, int], Counter] = {}

    def request(self, route: str, status: int) -> Counter:
        """The finished-requests counter of this route and status, made on first use."""
        series = self.requests.get((route, status))
        if series is None:
            series = self._metrics.requests.labels(
                route, outcome_of(status), str(status), self.model, self.adapter
            )
            self.requests[(route, status)] = series
        return series


class RouterMetrics:
    """The router's metrics; `observe` is the per-request hook, `render` the exposition."""

    def __init__(self, router: Observed) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "narwhal_requests",
            "Finished client requests by route, outcome, HTTP status, model and adapter.",
            ["route", "outcome", "status", *MODEL_LABELS],
            registry=registry,
        )
        self.request_errors = Counter(
            "narwhal_request_errors",
            "Failed client requests by route, the cause of the final failure, model and adapter.",
            ["route", "cause", *MODEL_LABELS],
            registry=registry,
        )
        # Each request counts into labelled series: looked up once per (model, adapter),
        # then kept (the statuses and handoff kinds are few).
        self._by_model: dict[str, dict[str, ModelSeries]] = {}
        self._handoff_series: dict[str, Counter] = {}

        # Observed on the event loop, several per request: read by a collector when scraped.
        self.histograms: list[LoopHistogram | LoopHistogramFamily] = []

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> LoopHistogram:
            made = LoopHistogram(name, documentation, buckets)
            self.histograms.append(made)
            return made

        def by_model(
            name: str, documentation: str, buckets: tuple[float, ...]
        ) -> LoopHistogramFamily:
            made = LoopHistogramFamily(name, documentation, buckets, MODEL_LABELS)
            self.histograms.append(made)
            return made

        self.ttft = by_model(
            "narwhal_ttft_seconds", "Arrival to the producer's prefill answer.", LATENCY_BUCKETS
        )
        self.first_byte = by_model(
            "narwhal_first_byte_seconds",
            "Arrival to the first generated output the router observes.",
            LATENCY_BUCKETS,
        )
        self.handoff_gap = by_model(
            "narwhal_first_byte_after_ttft_seconds",
            "Prefill answer to first generated output: KV pull, decode scheduling, first step.",
            LATENCY_BUCKETS,
        )
        self.duration = by_model(
            "narwhal_request_duration_seconds",
            "Arrival to the request's end, on every path.",
            DURATION_BUCKETS,
        )
        self.queue_wait = by_model(
            "narwhal_queue_wait_seconds",
            "Time spent waiting for seats, summed over a request's attempts.",
            LATENCY_BUCKETS,
        )
        self.prefill = by_model(
            "narwhal_prefill_seconds",
            "Time spent in prefill legs, summed over a request's attempts.",
            LATENCY_BUCKETS,
        )
        self.decode = by_model(
            "narwhal_decode_seconds",
            "Decode leg from its request to the stream's end.",
            DURATION_BUCKETS,
        )
        self.attempts = Counter(
            "narwhal_attempts",
            "Prefill/decode attempts started, first tries and retries.",
            list(MODEL_LABELS),
            registry=registry,
        )
        self.output_tokens = Counter(
            "narwhal_output_tokens",
            "Generated tokens relayed to clients.",
            list(MODEL_LABELS),
            registry=registry,
        )
        self.handoffs = Counter(
            "narwhal_handoffs",
            "Handoffs that reached their decode, by kind: crossed, same_worker, recomputed.",
            ["kind"],
            registry=registry,
        )
        self.descriptor_rejections = Counter(
            "narwhal_descriptor_rejections",
            "Producer descriptors rejected before any decode was sent, by defect.",
            ["defect"],
            registry=registry,
        )
        self.continuations = Counter(
            "narwhal_continuations",
            "Replays sent to continue an answer whose consumer failed after output began.",
            registry=registry,
        )
        self.continued = Counter(
            "narwhal_continued_requests",
            "Requests that were continued at least once, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.continuation_refusals = Counter(
            "narwhal_continuation_refusals",
            "Answers cut mid-way that were not continued (bounds, budget, no consumer).",
            registry=registry,
        )
        self.replayed_tokens = Counter(
            "narwhal_replayed_tokens",
            "Generated tokens prefilled again by continuation replays.",
            registry=registry,
        )
        self.interruption = histogram(
            "narwhal_continuation_interruption_seconds",
            "From a consumer's failure to the replay's first token, per continued request.",
            LATENCY_BUCKETS,
        )
        self.loop_lag = histogram(
            "narwhal_event_loop_lag_seconds",
            f"How late a {LAG_INTERVAL_S:g} s sleep wakes on the router's event loop.",
            LAG_BUCKETS,
        )
        # Per tenant, for requests that have one (and their gauges, read when scraped).
        self.tenants = TenantMetrics(registry, router, LATENCY_BUCKETS)
        self.histograms.append(self.tenants.queue_wait)
        registry.register(_ScrapeTimeCollector(router))
        registry.register(_LoopHistograms(self.histograms))
        self._lag_task: asyncio.Task[None] | None = None
        # Every pool's base-weights series from the start, zeros included, so that
        # `increase()` sees a model's first request.
        for model in router.fleet.models():
            self.series(model, "")

    def series(self, model: str, adapter: str) -> ModelSeries:
        """The request series of `model` and `adapter` ("" for none), made on first use."""
        adapters = self._by_model.get(model)
        if adapters is None:
            adapters = self._by_model[model] = {}
        made = adapters.get(adapter)
        if made is None:
            made = adapters[adapter] = ModelSeries(self, model, adapter)
        return made

    def observe(self, call: Call, now: float) -> None:
        """Record one finished request."""
        route = call.endpoint.value
        adapters = self._by_model.get(call.model or "")
        labelled = None if adapters is None else adapters.get(call.adapter or "")
        if labelled is None:
            labelled = self.series(call.model or "", call.adapter or "")
        status = call.status
        series = labelled.requests.get((route, status))
        if series is None:
            series = labelled.request(route, status)
        series.inc()
        if status != 200 and call.cause is not None:
            self.request_errors.labels(route, call.cause, labelled.model, labelled.adapter).inc()
        labelled.duration.observe(now - call.arrival)
        if call.ttft_s is not None:
            labelled.ttft.observe(call.ttft_s)
            if call.first_byte_s is not None:
                labelled.handoff_gap.observe(call.first_byte_s - call.ttft_s)
        if call.first_byte_s is not None:
            labelled.first_byte.observe(call.first_byte_s)
        for histogram, seconds in (
            (labelled.queue_wait, call.queue_wait_s),
            (labelled.prefill, call.prefill_s),
            (labelled.decode, call.decode_s),
        ):
            if seconds is not None:
                histogram.observe(seconds)
        if call.attempts:
            labelled.attempts.inc(call.attempts)
        if call.output_tokens:
            labelled.output_tokens.inc(call.output_tokens)
        for kind in call.handoffs:
            handoffs = self._handoff_series.get(kind)
            if handoffs is None:
                handoffs = self._handoff_series[kind] = self.handoffs.labels(kind)
            handoffs.inc()
        if call.continuations:
            self.continuations.inc(call.continuations)
            self.continued.labels(call.outcome).inc()
            self.replayed_tokens.inc(call.replayed_tokens)
            self.interruption.observe(call.interruption_s)
        if call.continuation_refused is not None:
            self.continuation_refusals.inc()
        for error in call.errors:
            if isinstance(error, DescriptorRejected):
                self.descriptor_rejections.labels(error.defect.value).inc()
        if call.tenant is not None:
            self.tenants.observe(call, call.tenant)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition in the format the scraper accepts, and its content type."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type

    def start(self, spawn: Spawn) -> None:
        """Start watching the event loop's lag, in a task `spawn` starts; `stop` ends it."""
        self._lag_task = spawn(self._watch_loop(), "loop-lag")

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_task
            self._lag_task = None

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            slept_at = loop.time()
            await asyncio.sleep(LAG_INTERVAL_S)
            self.loop_lag.observe(max(0.0, loop.time() - slept_at - LAG_INTERVAL_S))


class _LoopHistograms(Collector):
    """The request histograms, read when scraped."""

    def __init__(self, histograms: list[LoopHistogram | LoopHistogramFamily]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for histogram in self.histograms:
            yield histogram.family()


class _ScrapeTimeCollector(Collector):
    """Reads the router's own state when scraped: gauges, engine standing, decode gaps."""

    def __init__(self, router: Observed) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router, fleet = self.router, self.router.fleet
        yield _gauge(
            "narwhal_requests_in_flight", "Client requests being served.", router.in_flight
        )
        yield _gauge("narwhal_requests_queued", "Requests waiting for a seat.", fleet.queued)
        yield _gauge(
            "narwhal_open_engine_legs",
            "Engine legs under way: prefills awaiting answers, decode streams open.",
            router.client.open_legs,
        )
        budget = router.budget
        yield CounterMetricFamily(
            "narwhal_retries", "Fresh attempts after a transient fault.", value=budget.spent
        )
        yield CounterMetricFamily(
            "narwhal_retry_budget_denials",
            "Retries refused because the retry budget had no credit.",
            value=budget.denied,
        )
        yield _gauge("narwhal_retry_budget_credit", "Retry credits left.", budget.credit)
        yield _gaps_histogram(router)
        yield from _engine_metrics(router)
        if router.controller is not None:
            yield from _controller_metrics(router.controller)
        if router.discovery is not None:
            yield from router.discovery.metrics()


def _controller_metrics(controller: ControlLoop) -> Iterator[Metric]:
    """The role controller (only when enabled): each engine's role, moves and advice."""
    roles = GaugeMetricFamily(
        "narwhal_engine_role",
        "The phase an engine serves now: 1 for its current role, 0 for the others.",
        labels=["engine", "role", "model"],
    )
    for engine in controller.fleet.engines:
        for role in Role:
            roles.add_metric([engine.id, role.value, engine.model], 1 if engine.role is role else 0)
    moves = CounterMetricFamily(
        "narwhal_controller_moves",
        "Engines the role controller moved to another phase, by reason.",
        labels=["reason"],
    )
    advice = CounterMetricFamily(
        "narwhal_controller_advice",
        "Moves the role controller advised in advisory mode (not applied), by reason.",
        labels=["reason"],
    )
    for reason in MOVE_REASONS:
        moves.add_metric([reason], controller.moves.get(reason, 0))
        advice.add_metric([reason], controller.advice.get(reason, 0))
    yield from (roles, moves, advice)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _gaps_histogram(router: Observed) -> HistogramMetricFamily:
    gaps = router.client.gaps
    return HistogramMetricFamily(
        "narwhal_inter_token_gap_seconds",
        "Gaps between reads of decode streams past their first token, as the router sees them.",
        buckets=gaps.cumulative(),
        sum_value=gaps.total,
    )


def _engine_metrics(router: Observed) -> Iterator[Metric]:
    """Every engine series, each labelled with the engine's id and its base model."""
    engines = router.fleet.engines
    now = asyncio.get_running_loop().time()
    info = GaugeMetricFamily(
        "narwhal_engine_info",
        "Configured engines (value 1).",
        labels=["engine", "role", "url", "model"],
    )
    state = GaugeMetricFamily(
        "narwhal_engine_state",
        "Breaker state: 1 for the engine's current state, 0 for the others.",
        labels=["engine", "state", "model"],
    )
    streak = GaugeMetricFamily(
        "narwhal_engine_streak", "Consecutive failed legs.", labels=["engine", "model"]
    )
    ejections = CounterMetricFamily(
        "narwhal_engine_ejections",
        "Times the breaker ejected the engine.",
        labels=["engine", "model"],
    )
    quarantines = CounterMetricFamily(
        "narwhal_engine_quarantines", "Quarantines after a failed leg.", labels=["engine", "model"]
    )
    spares = CounterMetricFamily(
        "narwhal_engine_ejections_spared",
        "Ejections withheld because they would leave too few engines of a phase.",
        labels=["engine", "model"],
    )
    crossed = CounterMetricFamily(
        "narwhal_engine_crossed_decodes",
        "Crossed handoffs the router sent the engine as their consumer.",
        labels=["engine", "model"],
    )
    prompt_tokens = CounterMetricFamily(
        "narwhal_engine_prompt_tokens",
        "Prompt tokens by source as the engine counts them (vllm:prompt_tokens_by_source), "
        "since the router started.",
        labels=["engine", "source", "model"],
    )
    silent = CounterMetricFamily(
        "narwhal_engine_silent_recomputes",
        "Readings in which crossed decodes moved no KV while the engine computed prompts.",
        labels=["engine", "model"],
    )
    reported = GaugeMetricFamily(
        "narwhal_engine_reported_requests",
        "Requests the engine reports running or waiting, at its last /metrics reading.",
        labels=["engine", "state", "model"],
    )
    panics = CounterMetricFamily(
        "narwhal_engine_panic_placements",
        "Requests placed on the engine while it was not admitted (panic placement).",
        labels=["engine", "model"],
    )
    probes = CounterMetricFamily(
        "narwhal_engine_probes",
        "Readmission probes by result.",
        labels=["engine", "result", "model"],
    )
    seats = GaugeMetricFamily(
        "narwhal_engine_seats_in_use",
        "Phase seats held by requests.",
        labels=["engine", "phase", "model"],
    )
    limits = GaugeMetricFamily(
        "narwhal_engine_seats_limit",
        "Phase seat limit (0 = unlimited).",
        labels=["engine", "phase", "model"],
    )
    failures = CounterMetricFamily(
        "narwhal_engine_leg_failures",
        "Failed legs counted against the engine, by cause.",
        labels=["engine", "cause", "model"],
    )
    abandoned = CounterMetricFamily(
        "narwhal_engine_abandoned_handoffs",
        "Descriptors from this producer the router dropped before any consumer got them "
        "(client gone, handoff expired, decode refused): their blocks stay held until "
        "the KV lease ends.",
        labels=["engine", "model"],
    )
    abandoned_blocks = CounterMetricFamily(
        "narwhal_engine_abandoned_blocks",
        "KV blocks named by abandoned handoffs' descriptors.",
        labels=["engine", "model"],
    )
    block_seconds = CounterMetricFamily(
        "narwhal_engine_abandoned_block_seconds",
        "Blocks of abandoned handoffs times the lease each had left when dropped.",
        labels=["engine", "model"],
    )
    released = CounterMetricFamily(
        "narwhal_engine_abandoned_releases",
        "Abandoned handoffs the router asked a consumer to release, by result: freed at once, "
        "or failed (the blocks wait for the lease).",
        labels=["engine", "result", "model"],
    )
    pinned = GaugeMetricFamily(
        "narwhal_engine_abandoned_pinned_blocks",
        "Blocks of abandoned handoffs still within their KV lease (the router's estimate).",
        labels=["engine", "model"],
    )
    adapters = GaugeMetricFamily(
        "narwhal_engine_adapters",
        "LoRA adapters the engine holds now, as the router knows them.",
        labels=["engine", "model"],
    )
    for engine in engines:
        name, model = engine.id, engine.model
        adapters.add_metric([name, model], len(engine.adapters))
        if engine.serves(Phase.PREFILL):
            tally = router.abandoned.tally(name)
            abandoned.add_metric([name, model], tally.handoffs)
            abandoned_blocks.add_metric([name, model], tally.blocks)
            block_seconds.add_metric([name, model], tally.block_seconds)
            pinned.add_metric([name, model], tally.pinned(now))
            released.add_metric([name, "freed", model], tally.released)
            released.add_metric([name, "failed", model], tally.release_failures)
        info.add_metric([name, engine.spec.role.value, engine.url, model], 1)
        current = engine.state(now)
        for member in EngineState:
            state.add_metric([name, member.value, model], 1 if member is current else 0)
        streak.add_metric([name, model], engine.streak)
        ejections.add_metric([name, model], engine.ejections)
        quarantines.add_metric([name, model], engine.quarantines)
        spares.add_metric([name, model], engine.spares)
        panics.add_metric([name, model], engine.panics)
        crossed.add_metric([name, model], engine.crossed_decodes)
        for source, count in engine.prompt_tokens.items():
            prompt_tokens.add_metric([name, source, model], count)
        silent.add_metric([name, model], engine.silent_recomputes)
        if engine.report is not None:
            for key, value in (
                ("running", engine.report.running),
                ("waiting", engine.report.waiting),
            ):
                if value is not None:
                    reported.add_metric([name, key, model], value)
        for result in (*PROBE_RESULTS, *(r for r in engine.probes if r not in PROBE_RESULTS)):
            probes.add_metric([name, result, model], engine.probes.get(result, 0))
        if engine.serves(Phase.PREFILL):
            seats.add_metric([name, Phase.PREFILL.value, model], engine.prefill_seats)
            limits.add_metric([name, Phase.PREFILL.value, model], engine.spec.max_prefill_seats)
        if engine.serves(Phase.DECODE):
            seats.add_metric([name, Phase.DECODE.value, model], engine.decode_seats)
            limits.add_metric([name, Phase.DECODE.value, model], engine.spec.max_decode_seats)
        for cause in (*ENGINE_CAUSES, *(c for c in engine.failures if c not in ENGINE_CAUSES)):
            failures.add_metric([name, cause, model], engine.failures.get(cause, 0))
    yield from (info, state, streak, ejections, quarantines, spares, panics, probes)
    yield from (seats, limits, failures, crossed, prompt_tokens, silent, reported)
    yield from (abandoned, abandoned_blocks, block_seconds, pinned, released, adapters)
