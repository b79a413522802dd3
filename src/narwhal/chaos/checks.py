"""The rules a soak judges each journal line, each client's view and the settled router by.

Pure functions: each takes what was observed and returns the problems found, as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from narwhal.chaos.load import Sent
from narwhal.protocol.errors import Cause

CLIENT_CLOSED = 499
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
    if line["attempts"] > max_attempts:
        problems.append(f"{rid}: {line['attempts']} attempts, over {max_attempts}")
    return problems


def view_problems(sent: Sent, line: Mapping[str, Any]) -> list[str]:
    """A client that stayed was told what its journal line says; 499 only if it left."""
    rid, status = line["client_request_id"], line["status"]
    if status == CLIENT_CLOSED and not sent.left:
        return [f"{rid}: journaled 499 but its client stayed"]
    if not sent.left and sent.seen != status:
        return [f"{rid}: the client was told {sent.seen}, the journal says {status}"]
    return []


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
