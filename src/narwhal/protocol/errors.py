"""Errors as values: every failure gets its cause, HTTP status and retry class where it is raised.

Whoever catches a `NarwhalError` reads these fields; nobody re-guesses them from a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson


class Cause(StrEnum):
    """Why a request or one of its legs failed; bounded, so usable as a metrics label."""

    # The client's own fault, found by the router or reported by an engine.
    BAD_REQUEST = "bad_request"
    # Router admission.
    UNAVAILABLE = "unavailable"
    DEADLINE = "deadline"
    # Engine faults.
    CONNECT = "connect"
    HTTP_STATUS = "http_status"
    PREFILL_TIMEOUT = "prefill_timeout"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    SILENCE = "silence"
    CLOSED_EARLY = "closed_early"
    DONE_BEFORE_TOKEN = "done_before_token"
    ERROR_OBJECT = "error_object"
    BAD_RESPONSE = "bad_response"
    DESCRIPTOR = "descriptor"
    HANDOFF_EXPIRED = "handoff_expired"


# Engine statuses that say "try elsewhere or later", as opposed to "this request is wrong".
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Engine 4xx answers that are the client's own fault: relayed with the engine's message.
CLIENT_FAULT_STATUSES = frozenset({400, 413, 422})

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    422: "BadRequestError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The OpenAI-style `type` for an HTTP status."""
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


class NarwhalError(Exception):
    """A failure the router answers with `status` and an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        cause: Cause,
        *,
        transient: bool = False,
        engine: str | None = None,
        retry_after: int | None = None,
        param: str | None = None,
        relayed: Mapping[str, Any] | None = None,
        code: str | None = None,
        refusal: str | None = None,
    ) -> None:
        """`param` names the request field at fault; `relayed` is an engine's own error
        object, answered to the client as the engine sent it; `code` is the body's `code`
        where OpenAI names one (`model_not_found`), else the status; `refusal` says which
        rule of admission refused the request (a tenant's limit, overload, shedding)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.cause = cause
        self.transient = transient
        self.engine = engine
        self.retry_after = retry_after
        self.param = param
        self.relayed = relayed
        self.code = code
        self.refusal = refusal

    @property
    def is_engine_fault(self) -> bool:
        """True when an engine misbehaved (counts against it), false for client or admission."""
        return self.engine is not None and self.cause is not Cause.BAD_REQUEST

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        if self.relayed is not None:
            return {"error": dict(self.relayed)}
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.status if self.code is None else self.code,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The terminal event sent once a 200 stream has been committed."""
        return b"data: " + self.json() + b"\n\ndata: [DONE]\n\n"

    def __repr__(self) -> str:
        return f"NarwhalError({self.status}, {self.message!r}, {self.cause})"


def client_error(status: int, message: str, param: str | None = None) -> NarwhalError:
    """The client's own fault (never retried, never counted against an engine)."""
    return NarwhalError(status, message, Cause.BAD_REQUEST, param=param)


def engine_error(
    cause: Cause,
    message: str,
    engine: str,
    *,
    status: int | None = None,
    detail: Mapping[str, Any] | None = None,
) -> NarwhalError:
    """An engine fault; its router status and retry class follow from the cause, once, here.

    `detail` is the engine's error object: when the engine blames the request, the client
    gets it unchanged (its `param` names the field, its `type` and `code` are vLLM's).
    """
    if cause in (
        Cause.PREFILL_TIMEOUT,
        Cause.FIRST_TOKEN_TIMEOUT,
        Cause.SILENCE,
        Cause.HANDOFF_EXPIRED,
    ):
        return NarwhalError(504, message, cause, transient=True, engine=engine)
    if cause is Cause.HTTP_STATUS or cause is Cause.ERROR_OBJECT:
        upstream = status if status is not None else 500
        if upstream in CLIENT_FAULT_STATUSES:
            return NarwhalError(upstream, message, Cause.BAD_REQUEST, engine=engine, relayed=detail)
        transient = upstream in TRANSIENT_STATUSES
        if cause is Cause.ERROR_OBJECT:
            # An error object in a 200 stream keeps its own status.
            return NarwhalError(upstream, message, cause, transient=transient, engine=engine)
        routed = 504 if upstream in (408, 504) else 502
        return NarwhalError(routed, message, cause, transient=transient, engine=engine)
    # Connect failures, early closes, [DONE] before output, unreadable answers and rejected
    # descriptors: a fresh attempt on other engines may well succeed.
    return NarwhalError(502, message, cause, transient=True, engine=engine)
