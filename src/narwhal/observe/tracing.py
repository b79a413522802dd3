"""OpenTelemetry spans for the request path, when tracing is on.

One SERVER span per client request; under it one span per attempt, holding that attempt's
queueing, prefill, handoff check and decode (to its first token); and the relay. The spans
follow the request's stages (`Call.enter`) and read their attributes from the `Call` when
they end, so the request path itself only announces stages. Nothing of a prompt or its
output is recorded: ids, kinds, counts, statuses and causes.

Each engine leg carries its own span (prefill or decode) as the parent in `traceparent`, so
an engine that traces joins the same trace. This module is imported only when tracing is on.
"""

from __future__ import annotations

import functools
import time
from importlib.metadata import PackageNotFoundError, version

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceFlags, TraceState

from narwhal.config.tracing import TracingSettings
from narwhal.protocol.errors import NarwhalError
from narwhal.protocol.tracecontext import (
    format_traceparent,
    header_lines,
    parse_traceparent,
    usable_tracestate,
)
from narwhal.router.call import CLIENT_CLOSED, Call, Stage

# Span names of the stages; the request's own span is named "<method> <route>".
STAGE_SPANS = {
    Stage.QUEUED: "narwhal.queue",
    Stage.PREFILL: "narwhal.prefill",
    Stage.HANDOFF: "narwhal.handoff",
    Stage.DECODE: "narwhal.decode",
    Stage.RELAY: "narwhal.relay",
}
ATTEMPT_SPAN = "narwhal.attempt"
# The legs are requests to an engine: CLIENT spans.
_KINDS = {Stage.PREFILL: SpanKind.CLIENT, Stage.DECODE: SpanKind.CLIENT}

# Attribute names: OpenTelemetry's semantic conventions where they have one, else ours.
METHOD = "http.request.method"
ROUTE = "http.route"
STATUS_CODE = "http.response.status_code"
ERROR_TYPE = "error.type"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
MODEL = "gen_ai.request.model"
REQUEST_ID = "narwhal.request_id"
CLIENT_REQUEST_ID = "narwhal.client_request_id"
BACKEND_REQUEST_ID = "narwhal.backend_request_id"
ATTEMPT = "narwhal.attempt"
ATTEMPTS = "narwhal.attempts"
PRODUCER = "narwhal.producer.engine_id"
CONSUMER = "narwhal.consumer.engine_id"
HANDOFF = "narwhal.handoff.kind"
STREAM = "narwhal.stream"
OUTCOME = "narwhal.outcome"
CAUSE = "narwhal.error.cause"
ERROR_ENGINE = "narwhal.error.engine_id"
ERROR_STATUS = "narwhal.error.status"
RETRY_DENIED = "narwhal.retry_denied"
PANIC = "narwhal.panic"


class Tracing:
    """The router's tracer, on its own provider (the process-wide one is left alone)."""

    def __init__(self, provider: TracerProvider, model: str | None = None) -> None:
        self.provider = provider
        self.model = model
        self.tracer = provider.get_tracer("narwhal", _version())

    @classmethod
    def start(cls, settings: TracingSettings, model: str | None = None) -> Tracing:
        """Export over OTLP/HTTP in batches, from a thread of the SDK's own."""
        # Imported here: the exporter brings protobuf and requests, which only this needs.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        attributes: dict[str, str] = {SERVICE_VERSION: _version()}
        if settings.service_name is not None:
            attributes[SERVICE_NAME] = settings.service_name
        sampler = None
        if settings.sample_ratio is not None:
            sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(settings.endpoint)))
        return cls(provider, model)

    def begin(self, call: Call, traceparent: str | None, tracestate: str | None) -> RequestTrace:
        """The request's span, a child of the client's context when it sent a valid one."""
        parent: Context | None = None
        if traceparent is not None:
            found = parse_traceparent(traceparent)
            if found is not None:
                state = usable_tracestate(tracestate)
                remote = SpanContext(
                    found.trace_id,
                    found.span_id,
                    is_remote=True,
                    trace_flags=TraceFlags(found.flags & TraceFlags.SAMPLED),
                    trace_state=TraceState.from_header([state]) if state else None,
                )
                parent = trace.set_span_in_context(NonRecordingSpan(remote))
        return RequestTrace(self, call, parent)

    def shutdown(self) -> None:
        """Flush the spans still batched and stop exporting (blocks; call off the loop)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans: the request's, the open attempt's and the open stage's."""

    __slots__ = (
        "_attempt",
        "_attempt_context",
        "_attempt_no",
        "_handoffs_at",
        "_origin_ns",
        "_origin_s",
        "_recording",
        "_root",
        "_root_context",
        "_stage",
        "_stage_kind",
        "_tracer",
    )

    def __init__(self, tracing: Tracing, call: Call, parent: Context | None) -> None:
        # Span times come from the perf counter the Call uses, anchored once to the wall
        # clock, so that the spans nest exactly as the stages did.
        self._origin_ns = time.time_ns()
        self._origin_s = time.perf_counter()
        self._tracer = tracing.tracer
        route = call.endpoint.value
        attributes: dict[str, str | bool] = {
            METHOD: "POST",
            ROUTE: route,
            REQUEST_ID: call.request_id,
        }
        if call.client_request_id:
            attributes[CLIENT_REQUEST_ID] = call.client_request_id
        if tracing.model:
            attributes[MODEL] = tracing.model
        self._root = self._tracer.start_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(call.arrival),
        )
        # A request left out by sampling gets no child spans: they would be left out too,
        # and its legs carry the request span's context (not sampled) instead.
        self._recording = self._root.is_recording()
        self._root_context = trace.set_span_in_context(self._root)
        self._attempt: Span | None = None
        self._attempt_context = self._root_context
        self._attempt_no = 0
        self._handoffs_at = 0
        self._stage: Span | None = None
        self._stage_kind: Stage | None = None

    def _ns(self, at: float) -> int:
        return self._origin_ns + round((at - self._origin_s) * 1e9)

    # Told by the Call -----------------------------------------------------------------

    def enter(self, call: Call, stage: Stage, now: float) -> None:
        """End the open stage's span and open the next one (a new attempt at each queue)."""
        if not self._recording:
            return
        self._end_stage(call, now, None)
        if stage is Stage.QUEUED:
            self._end_attempt(call, now, None)
            # The Call counts an attempt once it is placed; its queueing comes first.
            self._attempt_no = call.attempts + 1
            self._handoffs_at = len(call.handoffs)
            self._attempt = self._tracer.start_span(
                ATTEMPT_SPAN,
                context=self._root_context,
                attributes={ATTEMPT: self._attempt_no},
                start_time=self._ns(now),
            )
            self._attempt_context = trace.set_span_in_context(self._attempt)
        elif stage is Stage.RELAY:
            # The attempt produced its first token: it succeeded, and relaying is the request's.
            self._end_attempt(call, now, None)
        name = STAGE_SPANS.get(stage)
        if name is None:
            return
        # The relay, after the attempt, is the request's own.
        parent = self._attempt_context if self._attempt is not None else self._root_context
        self._stage = self._tracer.start_span(
            name,
            context=parent,
            kind=_KINDS.get(stage, SpanKind.INTERNAL),
            attributes=self._stage_start(call, stage),
            start_time=self._ns(now),
        )
        self._stage_kind = stage

    def attempt_failed(self, call: Call, error: NarwhalError, now: float) -> None:
        if not self._recording:
            return
        self._end_stage(call, now, error)
        self._end_attempt(call, now, error)

    def leg_headers(self) -> bytes:
        """`traceparent` (and `tracestate`) naming the open stage's span, for its leg."""
        span = self._stage if self._stage is not None else self._root
        context = span.get_span_context()
        state = context.trace_state.to_header() if context.trace_state else None
        parent = format_traceparent(context.trace_id, context.span_id, context.trace_flags)
        return header_lines(parent, usable_tracestate(state))

    def end(self, call: Call, now: float) -> None:
        """The request is over: close what is open, then its own span with the outcome."""
        if not self._recording:
            self._root.end()
            return
        # `cause` is set by the request's final failure only (not when the client left).
        error = call.errors[-1] if call.cause is not None and call.errors else None
        self._end_stage(call, now, error)
        self._end_attempt(call, now, error)
        root = self._root
        root.set_attributes(_summary(call))
        root.set_attributes(self._engines(call))
        if call.status >= 500 and call.status != CLIENT_CLOSED:
            root.set_attribute(ERROR_TYPE, call.cause or str(call.status))
            root.set_status(Status(StatusCode.ERROR, call.cause))
        elif call.cause and call.status != 200:
            root.set_attribute(ERROR_TYPE, call.cause)
        root.end(self._ns(now))

    # Closing --------------------------------------------------------------------------

    def _end_stage(self, call: Call, now: float, error: NarwhalError | None) -> None:
        span, stage = self._stage, self._stage_kind
        if span is None or stage is None:
            return
        self._stage = self._stage_kind = None
        if error is not None:
            _failed(span, error)
        else:
            span.set_attributes(self._stage_end(call, stage))
        span.end(self._ns(now))

    # What the latest attempt did, read from the Call ------------------------------------

    def _placed(self, call: Call) -> bool:
        """Whether the attempt got its engines (the Call's engines are then its own)."""
        return self._attempt_no > 0 and call.attempts == self._attempt_no

    def _handoff(self, call: Call) -> str | None:
        """The attempt's handoff kind once decided (`Call.handoff` may be an older one's)."""
        return call.handoffs[-1] if len(call.handoffs) > self._handoffs_at else None

    def _engines(self, call: Call) -> dict[str, str]:
        """The attempt's engines and handoff kind; none for an attempt never placed."""
        attributes: dict[str, str] = {}
        if not self._placed(call):
            return attributes
        if call.producer is not None:
            attributes[PRODUCER] = call.producer
        if call.consumer is not None:
            attributes[CONSUMER] = call.consumer
        handoff = self._handoff(call)
        if handoff is not None:
            attributes[HANDOFF] = handoff
        return attributes

    def _stage_start(self, call: Call, stage: Stage) -> dict[str, str | int]:
        """What is known of a stage as it opens (past the queue, the attempt is placed).

        The attempt's number is on its own span, the stage's parent, so not here again.
        """
        attributes: dict[str, str | int] = {}
        if stage is Stage.QUEUED or stage is Stage.RELAY:
            return attributes
        if stage is not Stage.DECODE and call.producer is not None:
            attributes[PRODUCER] = call.producer
        if stage is not Stage.PREFILL and call.consumer is not None:
            attributes[CONSUMER] = call.consumer
        if stage is not Stage.HANDOFF and call.backend_request_ids:
            attributes[BACKEND_REQUEST_ID] = call.backend_request_ids[-1]
        handoff = self._handoff(call)
        if stage is Stage.DECODE and handoff is not None:
            attributes[HANDOFF] = handoff
        return attributes

    def _stage_end(self, call: Call, stage: Stage) -> dict[str, str | int]:
        """What a stage that went well learnt by its end."""
        if stage is Stage.PREFILL and call.prompt_tokens is not None:
            return {INPUT_TOKENS: call.prompt_tokens}
        handoff = self._handoff(call)
        if stage is Stage.HANDOFF and handoff is not None:
            return {HANDOFF: handoff}
        if stage is Stage.RELAY and call.output_tokens is not None:
            return {OUTPUT_TOKENS: call.output_tokens}
        return {}

    def _end_attempt(self, call: Call, now: float, error: NarwhalError | None) -> None:
        span = self._attempt
        if span is None:
            return
        self._attempt = None
        span.set_attributes(self._engines(call))
        span.set_attribute(OUTCOME, "error" if error is not None else "ok")
        if error is not None:
            _failed(span, error)
        span.end(self._ns(now))


def _summary(call: Call) -> dict[str, str | int | bool]:
    """The request's own span at its end: what an operator filters requests by."""
    attributes: dict[str, str | int | bool] = {
        STATUS_CODE: call.status,
        OUTCOME: call.outcome,
        ATTEMPTS: call.attempts,
        STREAM: call.stream,
        RETRY_DENIED: call.retry_denied,
        PANIC: call.panic,
    }
    if call.prompt_tokens is not None:
        attributes[INPUT_TOKENS] = call.prompt_tokens
    if call.output_tokens is not None:
        attributes[OUTPUT_TOKENS] = call.output_tokens
    if call.cause is not None:
        attributes[CAUSE] = call.cause
    return attributes


def _failed(span: Span, error: NarwhalError) -> None:
    """Mark a span failed by its cause (the message may quote an engine, so it stays out)."""
    cause = error.cause.value
    span.set_attribute(ERROR_TYPE, cause)
    span.set_attribute(CAUSE, cause)
    span.set_attribute(ERROR_STATUS, error.status)
    if error.engine is not None:
        span.set_attribute(ERROR_ENGINE, error.engine)
    span.set_status(Status(StatusCode.ERROR, cause))


@functools.cache
def _version() -> str:
    try:
        return version("narwhal")
    except PackageNotFoundError:
        return "unknown"
