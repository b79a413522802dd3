"""The rules a soak judges each journal line, each client's view and the settled router by.

Pure functions: each takes what was observed and returns the problems found, as text.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from narwhal.protocol.errors import Cause
from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.chaos.load import Sent

CLIENT_CLOSED = 499
NO_ENGINE = "no engine can "
# How long after an engine accepts connections again a 503 for lack of an engine is still
# fair. The router learns it is back from a `/health` probe of its urgent readmission tick,
# every `readmit_interval_s` (0.3 s in the soak) after the previous tick has judged every
# ejected engine, which may take a probe's health check and two legs (0.5 + 2 x 0.8 s);
# on a busy 2-core machine the event loop adds its own lag on top of that (a soak beside
# two busy loops needed up to 1.7 s, an idle one 0.6 s).
READMIT_GRACE_S = 3.0
# The router's own reasons to answer 429 or 503, by how its message begins.
_UNAVAILABLE = (
    ("the router's queue is full", "queue full"),
    ("no seat became free within", "no seat within the queue timeout"),
    (NO_ENGINE + "prefill", "no engine can prefill"),
    (NO_ENGINE + "decode", "no engine can decode"),
    ("the router is shutting down", "shutting down"),
    ("the router shut down", "shutting down"),
)
_TIMEOUT_CAUSES = {
    Cause.DEADLINE,
    Cause.PREFILL_TIMEOUT,
    Cause.FIRST_TOKEN_TIMEOUT,
    Cause.SILENCE,
    Cause.HANDOFF_EXPIRED,
}
_BAD_GATEWAY_CAUSES = {
    Cause.CONNECT,
    Cause.CLOSED_EARLY,
    Cause.DONE_BEFORE_TOKEN,
    Cause.BAD_RESPONSE,
    Cause.DESCRIPTOR,
}
_OUTCOMES = {200: "ok", CLIENT_CLOSED: "client_closed", 504: "timeout"}


def status_allowed(status: int, cause: str | None) -> bool:
    """The rules: each cause answers with the statuses it may have, and no other."""
    if cause is None:
        return status in (200, CLIENT_CLOSED)
    if cause == Cause.BAD_REQUEST:
        return 400 <= status < 500 and status != CLIENT_CLOSED
    if cause == Cause.UNAVAILABLE:
        return status in (429, 503)
    if cause in _TIMEOUT_CAUSES:
        return status == 504
    if cause in _BAD_GATEWAY_CAUSES:
        return status == 502
    if cause == Cause.HTTP_STATUS:
        return status in (502, 504)
    if cause == Cause.ERROR_OBJECT:
        # An error object keeps its own status; a client-fault one is filed as bad_request.
        return 400 <= status <= 599 and status not in (400, 413, 422, CLIENT_CLOSED)
    return False


def line_problems(line: Mapping[str, Any], max_attempts: int) -> list[str]:
    """What is wrong with one journal line on its own: its status against its cause, its
    outcome and error against its status, its attempts against the limit."""
    status, cause, rid = line["status"], line["cause"], line["client_request_id"]
    problems = []
    if not status_allowed(status, cause):
        problems.append(f"{rid}: status {status} for cause {cause}")
    outcome = _OUTCOMES.get(status, "client_error" if status < 500 else "error")
    if line["outcome"] != outcome:
        problems.append(f"{rid}: outcome {line['outcome']} for status {status}")
    if (line["error"] is None) != (status == 200):
        problems.append(f"{rid}: error {line['error']!r} with status {status}")
    # Each continuation is one more attempt of its own (bounded by [continuation]).
    allowed = max_attempts + line.get("continuations", 0)
    if line["attempts"] > allowed:
        problems.append(f"{rid}: {line['attempts']} attempts, over {allowed}")
    return problems


def view_problems(sent: Sent, line: Mapping[str, Any]) -> list[str]:
    """A client that stayed was told what its journal line says; 499 only if it left."""
    rid, status = line["client_request_id"], line["status"]
    if status == CLIENT_CLOSED and not sent.left:
        return [f"{rid}: journaled 499 but its client stayed"]
    if not sent.left and sent.seen != status:
        return [f"{rid}: the client was told {sent.seen}, the journal says {status}"]
    return []


# Why an answer cut mid-way may end without being continued, as the journal records it
# (`continuation_refused_kind`): the request or answer could not be (`answer`), no other
# admitted consumer was to be had (`fleet`), or the continuation budget was spent
# (`budget`). `off` is no excuse: the router could have continued it.
_EXCUSED_KINDS = {"answer", "fleet", "budget"}
CONTINUATION_SHARE = 0.99


def cut_outcome(line: Mapping[str, Any]) -> str | None:
    """For an answer whose consumer failed after output began: `continued` when it ended
    complete, `excused` when it could not have been continued (see `cut_excuse`), else
    `failed`. None for any other line."""
    if not line.get("cut"):
        return None
    if line["status"] == 200:
        return "continued"
    return "failed" if cut_excuse(line) is None else "excused"


def cut_excuse(line: Mapping[str, Any]) -> str | None:
    """Why a cut answer that did not end complete could not have been continued: the
    client left, the request's deadline passed, or the router's refusal kind (see
    `_EXCUSED_KINDS`); None when it could have been."""
    if line["status"] == CLIENT_CLOSED:
        return "client left"
    if line["cause"] == Cause.DEADLINE:
        return "deadline"
    kind = line.get("continuation_refused_kind")
    return str(kind) if kind in _EXCUSED_KINDS else None


def continuation_problems(continued: int, failed: int) -> list[str]:
    """At least 99 % of the cut answers that could be continued ended complete."""
    could = continued + failed
    if could and continued < CONTINUATION_SHARE * could:
        return [
            f"only {continued} of {could} answers cut mid-way that could be continued "
            "ended complete"
        ]
    return []


def text_problems(sent: Sent, index_id: str) -> list[str]:
    """A complete answer holds exactly the text the engines generate for its request:
    nothing lost, nothing doubled, however many consumers it took."""
    if sent.text is None or sent.expected is None or sent.text == sent.expected:
        return []
    return [f"{index_id}: the client got {sent.text!r}, the engines generate {sent.expected!r}"]


def check_leaks(state: Mapping[str, Any]) -> list[str]:
    """Nothing in flight, queued, held open to an engine, or seated, once the load is over."""
    problems = [
        f"{key} = {state[key]}" for key in ("in_flight", "queued", "open_engine_legs") if state[key]
    ]
    for engine in state["engines"]:
        for phase in ("prefill", "decode"):
            seats = engine["seats"][phase]["in_use"]
            if seats:
                problems.append(f"engine {engine['id']} holds {seats} {phase} seats")
    return problems


def check_service(state: Mapping[str, Any]) -> list[str]:
    """Once faults stop and engines are back up, readmission returns every one to service."""
    return [
        f"engine {engine['id']} is {engine['state']}: {engine['ejection_reason']}"
        for engine in state["engines"]
        if engine["state"] != "admitted"
    ]


def unavailable_reason(line: Mapping[str, Any]) -> str | None:
    """Why a line's answer was 429 or 503 (None for other statuses), from its error text."""
    if line["status"] not in (429, 503):
        return None
    if line["cause"] != Cause.UNAVAILABLE:
        return f"an engine's {line['cause']}"
    error = line["error"] or ""
    return next((reason for start, reason in _UNAVAILABLE if error.startswith(start)), "other")


def no_engine_problems(line: Mapping[str, Any], downtime: Downtime) -> list[str]:
    """A 503 for lack of an engine only while every engine of that phase refused
    connections: at some moment of the request, each was down or just back."""
    error = line["error"]
    if line["status"] != 503 or not isinstance(error, str) or not error.startswith(NO_ENGINE):
        return []
    phase = error.removeprefix(NO_ENGINE).split(":", 1)[0]
    end = line["ts"]
    start = end - line["duration_s"]
    if downtime.all_down(phase, start, end, READMIT_GRACE_S):
        return []
    up = downtime.accepting_throughout(phase, start, end, READMIT_GRACE_S)
    return [
        f"{line['client_request_id']}: 503 {error!r}, but no moment of its "
        f"{line['duration_s']:.2f} s found every {phase} engine down"
        + (f" ({', '.join(up)} accepted connections throughout)" if up else "")
    ]


@dataclass(slots=True)
class AbandonedTotals:
    """One producer's abandoned handoffs, as the journal or the router's metrics count them."""

    handoffs: int = 0
    blocks: int = 0
    block_seconds: float = 0.0


def add_journal_abandoned(line: Mapping[str, Any], totals: dict[str, AbandonedTotals]) -> None:
    """Add a request line's abandoned handoffs to the per-producer totals."""
    field = line.get("abandoned_handoffs") or {}
    for handoff in field.get("handoffs", ()):
        entry = totals.setdefault(handoff["producer"], AbandonedTotals())
        entry.handoffs += 1
        entry.blocks += handoff["blocks"]
        entry.block_seconds += handoff["block_seconds"]


_METRIC_FIELDS = {
    "narwhal_engine_abandoned_handoffs_total": "handoffs",
    "narwhal_engine_abandoned_blocks_total": "blocks",
    "narwhal_engine_abandoned_block_seconds_total": "block_seconds",
}


def metrics_abandoned(exposition: str) -> dict[str, AbandonedTotals]:
    """The router's abandoned-handoff counters per producer, from its `/metrics` text."""
    totals: dict[str, AbandonedTotals] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = _METRIC_FIELDS.get(sample.name)
            if name is None:
                continue
            entry = totals.setdefault(sample.labels["engine"], AbandonedTotals())
            value = sample.value if name == "block_seconds" else int(sample.value)
            setattr(entry, name, value)
    return totals


def abandoned_problems(
    journal: Mapping[str, AbandonedTotals], metrics: Mapping[str, AbandonedTotals]
) -> list[str]:
    """Every abandoned handoff on a journal line is in the router's counters, and no other:
    per producer, the same handoffs and blocks, and block-seconds up to rounding."""
    problems = []
    for producer in sorted({*journal, *metrics}):
        said = journal.get(producer, AbandonedTotals())
        counted = metrics.get(producer, AbandonedTotals())
        if (said.handoffs, said.blocks) != (counted.handoffs, counted.blocks) or not math.isclose(
            said.block_seconds, counted.block_seconds, rel_tol=1e-9, abs_tol=1e-6
        ):
            problems.append(
                f"producer {producer}: the journal has {said.handoffs} abandoned handoffs, "
                f"{said.blocks} blocks, {said.block_seconds:.3f} block-seconds; the metrics "
                f"{counted.handoffs}, {counted.blocks}, {counted.block_seconds:.3f}"
            )
    return problems


def moved_to(line: Mapping[str, Any]) -> str | None:
    """The phase a journaled `role_change` moved its engine to (its detail opens with
    "decode -> prefill"), or None for any other line."""
    if line.get("type") != "engine" or line.get("event") != "role_change":
        return None
    head = str(line.get("detail") or "").split(";", 1)[0]
    _, arrow, to = head.partition(" -> ")
    return to.strip() if arrow else None


def role_problems(
    engine: str, to: str, pinned: Collection[str], serving: Mapping[str, int], floor: int
) -> list[str]:
    """A move of a pinned engine, or one that left a phase (`serving`: engines per phase
    after the move) below its floor."""
    problems = [f"pinned engine {engine} moved to {to}"] if engine in pinned else []
    problems += [
        f"after {engine} moved to {to}, {phase} had {count} engines (floor {floor})"
        for phase, count in serving.items()
        if count < floor
    ]
    return problems
