"""The router's tracer: how it starts from settings, and a request's spans on their own."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from narwhal.app.process import _start_tracing
from narwhal.config.root import parse_config
from narwhal.config.tracing import TracingSettings
from narwhal.observe.tracing import Tracing
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.protocol.tracecontext import parse_traceparent
from narwhal.router.call import Call, Stage

CONFIG = parse_config(
    {
        "model": "tiny",
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
        ],
    }
)


def new_call() -> Call:
    return Call("rid", None, Endpoint.COMPLETIONS, time.perf_counter(), 0.0)


def test_tracing_starts_from_the_environment_and_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracing = _start_tracing(CONFIG)
    assert isinstance(tracing, Tracing)
    tracing.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _start_tracing(CONFIG) is None


def test_an_unsampled_request_still_passes_a_context_on() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing.start(TracingSettings("http://127.0.0.1:9/v1/traces", "t", 0.0))
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    call = new_call()
    call.trace = tracing.begin(call, None, None)
    call.enter(Stage.QUEUED)
    call.enter(Stage.PREFILL)
    lines = call.leg_headers().decode()
    assert lines.startswith("traceparent: ") and lines.endswith("\r\n")
    found = parse_traceparent(lines.removeprefix("traceparent: ").strip())
    assert found is not None and found.flags & 1 == 0
    call.finish(time.perf_counter())
    call.trace.end(call, time.perf_counter())
    tracing.shutdown()
    assert not exporter.get_finished_spans()


def test_a_request_failed_in_the_queue_names_no_engine() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    call = new_call()
    call.trace = Tracing(provider).begin(call, None, None)
    call.enter(Stage.QUEUED)
    error = NarwhalError(503, "no engine", Cause.UNAVAILABLE)
    call.fail(error)
    now = time.perf_counter()
    call.finish(now)
    call.trace.end(call, now)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "narwhal.attempt", "narwhal.queue"}
    for span in spans.values():
        attributes = dict(span.attributes or {})
        assert "narwhal.producer.engine_id" not in attributes
        assert attributes.get("error.type") == "unavailable"
