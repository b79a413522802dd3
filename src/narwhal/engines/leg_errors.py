"""Engine leg failures as errors, their cause and status decided once, where they arise."""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.engines.http import ConnectFailed, Connection, HttpError
from narwhal.protocol.errors import CLIENT_FAULT_STATUSES, Cause, NarwhalError, engine_error
from narwhal.protocol.sse import SseError, error_detail, error_status

MAX_ERROR_BODY_BYTES = 64 << 10


def bad_stream(exc: SseError, engine: str) -> NarwhalError:
    return engine_error(
        Cause.BAD_RESPONSE, f"engine {engine} sent a malformed stream: {exc}", engine
    )


def error_object(payload: dict[str, Any], engine: str) -> NarwhalError:
    status, message = error_status(payload)
    return engine_error(
        Cause.ERROR_OBJECT,
        f"engine {engine} reported an error: {message}",
        engine,
        status=status,
        detail=error_detail(payload),
    )


async def status_error(connection: Connection, engine: str, leg: str) -> NarwhalError:
    """A non-200 answer: the engine's own message, with the status's meaning decided once."""
    detail: dict[str, Any] | None = None
    try:
        payload = orjson.loads(await connection.read_all(MAX_ERROR_BODY_BYTES))
        if isinstance(payload, dict):
            _, message = error_status(payload)
            detail = error_detail(payload)
        else:
            message = ""
    except (HttpError, orjson.JSONDecodeError):
        message = ""
    status = connection.status
    if not message:
        message = connection.reason or "no error message"
    if status in CLIENT_FAULT_STATUSES:
        text = message
    else:
        text = f"{leg} on engine {engine} failed with HTTP {status}: {message}"
    return engine_error(Cause.HTTP_STATUS, text, engine, status=status, detail=detail)


def transport_error(exc: HttpError, engine: str, leg: str) -> NarwhalError:
    if isinstance(exc, ConnectFailed):
        return engine_error(
            Cause.CONNECT, f"could not connect to engine {engine} for {leg}: {exc}", engine
        )
    return engine_error(
        Cause.CONNECT, f"connection to engine {engine} failed during {leg}: {exc}", engine
    )
