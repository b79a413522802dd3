"""Tracing end to end: the span tree of real requests, and the trace context engines receive.

The router runs over real sockets in front of simulated engines, called by the official
client; its spans go to an in-memory exporter.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from narwhal.observe.tracing import Tracing
from narwhal.protocol.tracecontext import format_traceparent
from narwhal.tools.sim.engine import Received
from support.stack import MODEL, StackFactory, arm, settled

TWO_PRODUCERS = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "vendor=opaque,other=1"
CLIENT_HEADERS = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
PROMPT = "A secret prompt about narwhals"
OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
)


def memory_tracer() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, MODEL), exporter


async def finished(exporter: InMemorySpanExporter, roots: int = 1) -> list[ReadableSpan]:
    """The spans once `roots` request spans have ended (a stream's ends after its last byte)."""
    for _ in range(1000):
        spans = list(exporter.get_finished_spans())
        if sum(span.kind is SpanKind.SERVER for span in spans) >= roots:
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"{roots} request span(s) never ended")


def by_name(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def check_tree(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    """One trace, one root; each child lies within its parent; returns the root."""
    (root,) = [s for s in spans if s.kind is SpanKind.SERVER]
    ids = {span_id(s): s for s in spans}
    assert root.context is not None
    assert {s.context.trace_id for s in spans if s.context} == {root.context.trace_id}
    for span in spans:
        assert span.start_time is not None and span.end_time is not None
        assert span.end_time >= span.start_time, span.name
        if span is root:
            continue
        parent = ids[span.parent.span_id if span.parent is not None else 0]
        assert parent.start_time is not None and parent.end_time is not None
        assert parent.start_time <= span.start_time, span.name
        assert span.end_time <= parent.end_time, span.name
    return root


def in_order(spans: Sequence[ReadableSpan]) -> None:
    """Siblings one after another: each starts no earlier than the previous one ended."""
    for before, after in itertools.pairwise(spans):
        assert before.end_time is not None and after.start_time is not None
        assert before.end_time <= after.start_time, (before.name, after.name)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def sent_to(received: Received, span: ReadableSpan) -> None:
    """The leg carried `span` as its parent, and the client's tracestate."""
    assert span.context is not None
    assert received.traceparent == format_traceparent(
        span.context.trace_id, span.context.span_id, int(span.context.trace_flags)
    )
    assert received.tracestate == TRACESTATE


def no_prompt_text(spans: Sequence[ReadableSpan]) -> None:
    for span in spans:
        assert not any(PROMPT in str(value) for value in attrs(span).values()), span.name


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_is_one_span_tree_and_each_leg_carries_its_own_span(
    make_stack: StackFactory, stream: bool
) -> None:
    tracer, exporter = memory_tracer()
    async with make_stack(tracer=tracer) as stack:
        client = stack.openai()
        answer: Any = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, stream=stream, extra_headers=CLIENT_HEADERS
        )
        if stream:
            assert [chunk async for chunk in answer]
        spans = await finished(exporter)
        await settled(stack)

    root = check_tree(spans)
    assert root.name == "POST /v1/completions"
    assert root.context is not None and root.context.trace_id == CLIENT_TRACE
    assert parent_id(root) == CLIENT_SPAN
    assert attrs(root) | {
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
        "narwhal.outcome": "ok",
        "narwhal.attempts": 1,
        "narwhal.stream": stream,
        "narwhal.producer.engine_id": "p0",
        "narwhal.consumer.engine_id": "d0",
        "narwhal.handoff.kind": "crossed",
        "gen_ai.usage.output_tokens": 7,
    } == attrs(root)
    assert attrs(root)["gen_ai.usage.input_tokens"] > 0
    assert root.status.status_code is StatusCode.UNSET

    (attempt,) = by_name(spans, "narwhal.attempt")
    assert parent_id(attempt) == span_id(root)
    assert attrs(attempt)["narwhal.attempt"] == 1 and attrs(attempt)["narwhal.outcome"] == "ok"
    legs = [by_name(spans, f"narwhal.{n}")[0] for n in ("queue", "prefill", "handoff", "decode")]
    assert all(parent_id(span) == span_id(attempt) for span in legs)
    _, prefill, handoff, decode = legs
    (relay,) = by_name(spans, "narwhal.relay")
    assert parent_id(relay) == span_id(root)
    in_order([*legs, relay])
    in_order([attempt, relay])
    assert prefill.kind is SpanKind.CLIENT and decode.kind is SpanKind.CLIENT
    assert attrs(prefill)["narwhal.producer.engine_id"] == "p0"
    assert attrs(prefill)["gen_ai.usage.input_tokens"] == attrs(root)["gen_ai.usage.input_tokens"]
    assert attrs(handoff)["narwhal.handoff.kind"] == "crossed"
    assert attrs(decode)["narwhal.consumer.engine_id"] == "d0"
    assert attrs(relay)["gen_ai.usage.output_tokens"] == 7
    assert len(spans) == 7
    no_prompt_text(spans)

    (prefill_leg,) = stack.engine("p0").received
    (decode_leg,) = stack.engine("d0").received
    sent_to(prefill_leg, prefill)
    sent_to(decode_leg, decode)
    assert attrs(prefill)["narwhal.backend_request_id"] == prefill_leg.request_id


async def test_a_retried_request_has_one_span_per_attempt_and_failures_say_why(
    make_stack: StackFactory,
) -> None:
    tracer, exporter = memory_tracer()
    async with make_stack(TWO_PRODUCERS, serving={"max_attempts": 3}, tracer=tracer) as stack:
        for name in ("p0", "p1"):
            arm(stack.engine(name), phase="prefill", status=503, times=1)
        client = stack.openai()
        answer = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, extra_headers=CLIENT_HEADERS
        )
        assert answer.choices[0].text
        spans = await finished(exporter)
        await settled(stack)

    root = check_tree(spans)
    assert attrs(root)["narwhal.attempts"] == 3
    assert attrs(root)["http.response.status_code"] == 200
    attempts = by_name(spans, "narwhal.attempt")
    assert [attrs(a)["narwhal.attempt"] for a in attempts] == [1, 2, 3]
    assert all(parent_id(a) == span_id(root) for a in attempts)
    in_order(attempts)
    # Both producers failed once and sit in quarantine: the third attempt is the
    # consumer's own (aggregate fallback), with no prefill leg.
    prefills = by_name(spans, "narwhal.prefill")
    assert len(prefills) == 2
    for attempt, prefill in zip(attempts, prefills, strict=False):
        assert parent_id(prefill) == span_id(attempt)
        for span in (attempt, prefill):
            assert span.status.status_code is StatusCode.ERROR
            assert attrs(span)["error.type"] == "http_status"
            assert attrs(span)["narwhal.error.status"] == 502
        assert attrs(attempt)["narwhal.outcome"] == "error"
        assert "narwhal.handoff.kind" not in attrs(attempt)
        producer = attrs(prefill)["narwhal.producer.engine_id"]
        assert attrs(prefill)["narwhal.error.engine_id"] == producer
    assert {attrs(p)["narwhal.producer.engine_id"] for p in prefills} == {"p0", "p1"}
    last = attempts[2]
    assert attrs(last)["narwhal.outcome"] == "ok"
    assert attrs(last)["narwhal.handoff.kind"] == "fallback"
    assert last.status.status_code is StatusCode.UNSET
    assert not by_name(spans, "narwhal.handoff")
    (decode,) = by_name(spans, "narwhal.decode")
    assert parent_id(decode) == span_id(last)
    assert len(by_name(spans, "narwhal.queue")) == 3
    assert root.status.status_code is StatusCode.UNSET
    assert attrs(root)["narwhal.handoff.kind"] == "fallback"
    no_prompt_text(spans)

    # Every prefill leg carried its own attempt's prefill span, the decode leg its own.
    by_backend_id = {attrs(p)["narwhal.backend_request_id"]: p for p in prefills}
    legs = [*stack.engine("p0").received, *stack.engine("p1").received]
    assert len(legs) == 2
    for received in legs:
        sent_to(received, by_backend_id[received.request_id])
    (decode_leg,) = stack.engine("d0").received
    sent_to(decode_leg, decode)


async def test_a_failed_request_marks_its_span_an_error(make_stack: StackFactory) -> None:
    tracer, exporter = memory_tracer()
    async with make_stack(tracer=tracer) as stack:
        arm(stack.engine("d0"), phase="decode", status=503)
        status, _ = await stack.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        )
        assert status == 502
        spans = await finished(exporter)
    root = check_tree(spans)
    assert root.status.status_code is StatusCode.ERROR
    assert attrs(root)["error.type"] == "http_status"
    assert attrs(root)["narwhal.outcome"] == "error"
    assert attrs(root)["http.response.status_code"] == 502
    (decode,) = by_name(spans, "narwhal.decode")
    assert decode.status.status_code is StatusCode.ERROR
    assert attrs(decode)["narwhal.error.engine_id"] == "d0"
    assert not by_name(spans, "narwhal.relay")


async def test_without_a_client_context_the_router_starts_the_trace(
    make_stack: StackFactory,
) -> None:
    tracer, exporter = memory_tracer()
    async with make_stack(tracer=tracer) as stack:
        status, _ = await stack.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        )
        assert status == 200
        spans = await finished(exporter)
    root = check_tree(spans)
    assert root.parent is None
    (prefill_leg,) = stack.engine("p0").received
    prefill = by_name(spans, "narwhal.prefill")[0]
    assert prefill.context is not None and prefill.context.trace_flags.sampled
    assert prefill_leg.traceparent == format_traceparent(
        prefill.context.trace_id, prefill.context.span_id, int(prefill.context.trace_flags)
    )
    assert prefill_leg.tracestate is None


async def test_with_tracing_off_the_client_context_reaches_both_engines_unchanged(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    async with make_stack() as stack:
        assert stack.server.router.tracing is None
        client = stack.openai()
        await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_headers=CLIENT_HEADERS
        )
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, stream=True, extra_headers=CLIENT_HEADERS
        )
        assert [chunk async for chunk in stream]
        # No context, or one that is not valid: nothing is passed on.
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            extra_headers={"traceparent": "00-zz-00f067aa0ba902b7-01", "tracestate": "a=b"},
        )
        await settled(stack)
    for name in ("p0", "d0"):
        received = list(stack.engine(name).received)
        assert [(r.traceparent, r.tracestate) for r in received] == [
            (TRACEPARENT, TRACESTATE),
            (TRACEPARENT, TRACESTATE),
            (None, None),
            (None, None),
        ]
