"""Notable events as log lines and journal lines: engine state changes and failed requests.

One line per event, human-readable by default or one JSON object per line. Lines carry
the router's request id, statuses, causes and engine ids, never a request body or a
credential; an error message is cut short, since an engine's message may quote input.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from narwhal.fleet.table import EngineEvent, Fleet

if TYPE_CHECKING:
    from narwhal.router.call import Call

LOG_FORMATS = ("text", "json")
MAX_MESSAGE_CHARS = 300
# Engine events that take capacity away; the others are news of recovery.
_WARNING_EVENTS = frozenset({"ejected", "quarantined", "spared", "silent_recompute"})

engine_log = logging.getLogger("narwhal.engine")
request_log = logging.getLogger("narwhal.request")


def engine_entry(event: EngineEvent, model: str | None = None) -> dict[str, Any]:
    """The journal line for an engine state change; `model`: the engine's base model."""
    entry: dict[str, Any] = {
        "type": "engine",
        "ts": time.time(),
        "event": event.kind,
        "engine": event.engine,
        "model": model,
        "result": event.result,
        "detail": event.detail,
    }
    if event.reason is not None:
        entry["reason"] = event.reason
    if event.inputs is not None:
        entry["inputs"] = dict(event.inputs)
    return entry


class EngineLines:
    """Engine events as journal lines (`record`), each naming its engine's model: the one
    it serves now, or, for an engine the fleet has just forgotten, the one it served."""

    def __init__(self, fleet: Fleet, record: Callable[[dict[str, Any]], None]) -> None:
        self.fleet = fleet
        self.record = record
        self._models: dict[str, str] = {}

    def __call__(self, event: EngineEvent) -> None:
        engine = self.fleet.by_id.get(event.engine)
        if engine is not None:
            self._models[event.engine] = engine.model
            model: str | None = engine.model
        else:
            model = self._models.pop(event.engine, None)
        self.record(engine_entry(event, model))


def log_engine_event(event: EngineEvent) -> None:
    level = logging.WARNING if event.kind in _WARNING_EVENTS else logging.INFO
    result = f" ({event.result})" if event.result else ""
    detail = f": {_short(event.detail)}" if event.detail else ""
    engine_log.log(
        level,
        "engine %s %s%s%s",
        event.engine,
        event.kind,
        result,
        detail,
        extra={"fields": {"engine": event.engine, "event": event.kind, "result": event.result}},
    )


def log_call(call: Call, now: float) -> None:
    """A failed request: its status, cause and the engine at fault. Successes stay quiet."""
    if call.status == 200:
        return
    failure = call.errors[-1] if call.errors else None
    engine = failure.engine if failure is not None else None
    fields = {
        "request_id": call.request_id,
        "route": call.endpoint.value,
        "status": call.status,
        "outcome": call.outcome,
        "cause": call.cause,
        "engine": engine,
        "attempts": call.attempts,
        "duration_s": round(now - call.arrival, 4),
    }
    # A client's own mistake is routine for the router, and its message may echo the input.
    client_fault = call.status < 500
    level = logging.INFO if client_fault else logging.WARNING
    message = "" if client_fault or call.error is None else f": {_short(call.error)}"
    where = f" on engine {engine}" if engine else ""
    attempts = f"after {call.attempts} attempt{'s' * (call.attempts != 1)}"
    request_log.log(
        level,
        "request %s failed with %d (%s)%s %s%s",
        call.request_id,
        call.status,
        call.cause or call.outcome,
        where,
        attempts,
        message,
        extra={"fields": fields},
    )


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Send Narwhal's log lines to stderr in the chosen format (`text` or `json`)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("narwhal")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
