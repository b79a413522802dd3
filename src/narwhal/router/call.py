"""One client request's record: where it is, what happened, and the one outcome it ends with.

The request path fills it in; the journal, metrics, logs and the fleet page read it once,
when the request ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import NarwhalError
from narwhal.router.abandoned import Abandonment, journal_field

if TYPE_CHECKING:
    from narwhal.fleet.scheduler import Claim
    from narwhal.tenants.limits import Ticket

# The status recorded for a client that went away (nginx's convention; never sent).
CLIENT_CLOSED = 499
# Handoff kinds in which the prompt's prefill ran on another engine than the decode.
_CROSSED = frozenset({"crossed", "recomputed"})


class CallTrace(Protocol):
    """A request's spans as the request path tells them (`observe.tracing.RequestTrace`)."""

    def enter(self, call: Call, stage: Stage, now: float) -> None: ...

    def attempt_failed(self, call: Call, error: NarwhalError, now: float) -> None: ...

    def leg_headers(self) -> bytes: ...

    def end(self, call: Call, now: float) -> None: ...


class Stage(StrEnum):
    """Where a request is; named in deadline errors so the operator knows what was slow."""

    ADMISSION = "reading the request"
    QUEUED = "waiting for a seat"
    PREFILL = "waiting for the prefill"
    HANDOFF = "validating the handoff"
    DECODE = "waiting for the first token"
    RELAY = "relaying tokens"


@dataclass(slots=True)
class Call:
    """What happened to one client request; journaled once, when it ends."""

    request_id: str
    client_request_id: str | None
    endpoint: Endpoint
    # Measurements use `time.perf_counter()` (sub-millisecond); the deadline is in event-loop
    # time, which timeouts use.
    arrival: float
    deadline: float
    stream: bool = False
    # The pool (base model) it was served from, and its LoRA adapter where it named one;
    # None until its `model` was resolved.
    model: str | None = None
    adapter: str | None = None
    # Its tenant (`router.admission`), what its limits let it take, its claim on the seat
    # queue, and the headers every answer to it carries (`x-ratelimit-*`); None without.
    tenant: str | None = None
    ticket: Ticket | None = None
    claim: Claim | None = None
    headers: dict[str, str] | None = None
    # Why it was refused with 429 or 503, set where the refusal is raised (a bounded word,
    # a metrics label: max_concurrent, requests_per_minute, tokens_per_minute,
    # request_too_large, max_queued, overload, shed, queue_full); None when not refused.
    refusal: str | None = None
    producer: str | None = None
    consumer: str | None = None
    handoff: str | None = None
    attempts: int = 0
    backend_request_ids: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    first_byte_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    status: int = 0
    error: str | None = None
    cause: str | None = None
    stage: Stage = Stage.ADMISSION
    retry_denied: bool = False
    # Some attempt was placed on an engine that was not admitted (panic placement).
    panic: bool = False
    # The prompt's prefix placement expected its producer to hold, in chunks (last attempt).
    prefix_matched: int = 0
    # Every attempt's handoff kind, and every failure (failed attempts', then the final).
    handoffs: list[str] = field(default_factory=list)
    errors: list[NarwhalError] = field(default_factory=list)
    # Descriptors dropped before reaching a consumer (their producers hold the blocks).
    abandoned: list[Abandonment] = field(default_factory=list)
    # Seconds spent in each stage so far, summed over attempts; the current one began at
    # `stage_at`.
    spent: dict[Stage, float] = field(default_factory=dict)
    stage_at: float = field(init=False)
    # With tracing on, the request's spans, told of each stage; with it off, the client's
    # own trace context as header lines for the engine legs (b"" if it sent none).
    trace: CallTrace | None = None
    trace_lines: bytes = b""
    # Stream continuation: replays sent after a consumer failed mid-answer, the generated
    # tokens they prefilled again, the seconds from the failure to each replay's first
    # token, and why an answer that failed was not continued.
    continuations: int = 0
    replayed_tokens: int = 0
    interruption_s: float = 0.0
    continuation_refused: str | None = None
    # Its kind (`router.continuation`: answer, fleet, budget, off), and whether the
    # consumer failed after output began at all (whether or not it was continued).
    refused_kind: str | None = None
    cut: bool = False
    # Whether its decodes ask the engine for token ids (the request may be continued).
    tracks_ids: bool = False
    # On `/v1/responses`, the last relayed event's sequence number: the router's own
    # terminal event, should it end the stream, takes the next.
    sequence_number: int = -1

    def __post_init__(self) -> None:
        self.stage_at = self.arrival

    def enter(self, stage: Stage) -> None:
        """Move to `stage`, adding the time spent in the current one to `spent`."""
        now = time.perf_counter()
        self.finish(now)
        self.stage, self.stage_at = stage, now
        if self.trace is not None:
            self.trace.enter(self, stage, now)

    def attempt_failed(self, error: NarwhalError) -> None:
        """An attempt ended in `error` (the request may retry or fail with it)."""
        self.errors.append(error)
        if self.trace is not None:
            self.trace.attempt_failed(self, error, time.perf_counter())

    def leg_headers(self) -> bytes:
        """Trace context header lines for the engine leg about to be sent."""
        return self.trace_lines if self.trace is None else self.trace.leg_headers()

    def finish(self, now: float) -> None:
        """Count the current stage's time up to `now` (the request ends, or moves on)."""
        self.spent[self.stage] = self.spent.get(self.stage, 0.0) + now - self.stage_at
        self.stage_at = now

    def fail(self, error: NarwhalError) -> None:
        self.status, self.error, self.cause = error.status, error.message, error.cause.value
        if not self.errors or self.errors[-1] is not error:
            self.errors.append(error)

    @property
    def outcome(self) -> str:
        return outcome_of(self.status)

    @property
    def queue_wait_s(self) -> float | None:
        return self.spent.get(Stage.QUEUED)

    @property
    def prefill_s(self) -> float | None:
        return self.spent.get(Stage.PREFILL)

    @property
    def decode_s(self) -> float | None:
        """In decode legs: checking handoffs and waiting for first tokens (over attempts),
        then relaying."""
        if Stage.DECODE not in self.spent:
            return None
        spent = self.spent
        return spent[Stage.DECODE] + spent.get(Stage.HANDOFF, 0.0) + spent.get(Stage.RELAY, 0.0)

    def entry(self, now: float) -> dict[str, Any]:
        """Its journal line; `model` is None for a request refused before its model was
        known, and `adapter` is there only when it named one."""
        entry = {
            "type": "request",
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "endpoint": self.endpoint.value,
            "model": self.model,
            "stream": self.stream,
            "producer": self.producer,
            "consumer": self.consumer,
            "crossed": None if self.handoff is None else self.handoff in _CROSSED,
            "handoff": self.handoff,
            "panic": self.panic,
            "prefix_matched": self.prefix_matched,
            "attempts": self.attempts,
            "retry_denied": self.retry_denied,
            "backend_request_ids": self.backend_request_ids,
            "ttft_s": self.ttft_s,
            "first_byte_s": self.first_byte_s,
            "queue_wait_s": self.queue_wait_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "duration_s": now - self.arrival,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "status": self.status,
            "outcome": outcome_of(self.status),
            "cause": self.cause,
            "error": self.error,
            "continuations": self.continuations,
            "replayed_tokens": self.replayed_tokens,
            "interruption_s": self.interruption_s,
            "continuation_refused": self.continuation_refused,
            "continuation_refused_kind": self.refused_kind,
            "cut": self.cut,
            "abandoned_handoffs": journal_field(self.abandoned),
            "failures": [
                {"engine": e.engine, "cause": e.cause.value, "status": e.status}
                for e in self.errors
            ],
        }
        if self.adapter is not None:
            entry["adapter"] = self.adapter
        if self.tenant is not None:
            entry["tenant"] = self.tenant
        if self.refusal is not None:
            entry["refusal"] = self.refusal
        return entry


def outcome_of(status: int) -> str:
    """One bounded word per terminal status, for the journal and metrics."""
    if status == 200:
        return "ok"
    if status == CLIENT_CLOSED:
        return "client_closed"
    if status == 504:
        return "timeout"
    return "client_error" if status < 500 else "error"


# Told about each finished request once, with the time it ended.
CallHook = Callable[[Call, float], None]
