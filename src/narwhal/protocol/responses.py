"""The Responses API (`/v1/responses`), sans I/O: the client's body checked, the legs' bodies
built, a conversation's input rebuilt, and what each stream event means.

A Responses stream names each event (`event: response.output_text.delta`, the same name as
the payload's `type`) and numbers it (`sequence_number`); it has no `[DONE]`. What counts
is decided by the payload's `type` alone (docs/responses.md, "The stream's rules"):

- any `….delta` event is output: a generated token of text, reasoning, a refusal or a
  tool call's arguments;
- `response.completed` and `response.incomplete` end a stream well;
- `response.failed` and `error` end it with their own status;
- everything else (`response.created`, `response.in_progress`, the `…added` and `…done`
  events) is neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
import orjson

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.protocol.errors import client_error

# Members of the client's body the engines never see: the router keeps the conversation.
_ROUTER_ONLY = ("previous_response_id", "kv_transfer_params", "request_id")


@dataclass(frozen=True, slots=True)
class Ask:
    """What a Responses request asks of the router itself, apart from its engine body."""

    # Keep the response (OpenAI's default: true).
    store: bool
    previous_response_id: str | None
    # This turn's own input, as items (a string input is one user message).
    items: list[Any]


def check_responses_body(body: dict[str, Any]) -> Ask:
    """Check what the router relies on in a Responses body; the engines check the rest.
    Raises a 400 naming the member at fault."""
    if "input" not in body:
        raise client_error(400, "`input` is required", "input")
    items = input_items(body["input"])
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise client_error(400, "`store` must be a boolean", "store")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise client_error(
            400, "`previous_response_id` must be a non-empty string", "previous_response_id"
        )
    background = body.get("background")
    if background is not None and background is not False:
        raise client_error(
            400,
            "`background` is not supported: send the request in the foreground, with "
            "`stream: true` to follow it as it is generated",
            "background",
        )
    limit = body.get("max_output_tokens")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise client_error(
            400,
            f"`max_output_tokens` must be a positive integer, got {limit!r}",
            "max_output_tokens",
        )
    if "conversation" in body and body["conversation"] is not None:
        raise client_error(
            400,
            "`conversation` is not supported: chain responses with `previous_response_id`",
            "conversation",
        )
    return Ask(store, previous, items)


def input_items(value: object) -> list[Any]:
    """The input as a list of items: a string is one user message, of one text part (as
    OpenAI lists it among a response's input items)."""
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    if not isinstance(value, list) or not value:
        raise client_error(400, "`input` must be a string or a non-empty list of items", "input")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise client_error(400, f"`input[{index}]` must be an object", "input")
    return value


def conversation_input(turns: Sequence[tuple[list[Any], list[Any]]], items: list[Any]) -> list[Any]:
    """The whole input of a follow-up: each earlier turn's input items and output items, in
    order, then its own items."""
    whole: list[Any] = []
    for turn_input, turn_output in turns:
        whole += turn_input
        whole += turn_output
    whole += items
    return whole


def engine_body(body: Mapping[str, Any], whole_input: list[Any]) -> dict[str, Any]:
    """The client's body as the engines get it: the whole input, and nothing stored there."""
    sent = {key: value for key, value in body.items() if key not in _ROUTER_ONLY}
    sent["input"] = whole_input
    sent["store"] = False
    return sent


def response_id(backend_id: str) -> str:
    """The id of the response a try makes: vLLM names a response by its request's
    `request_id`, which a fresh try takes afresh."""
    return "resp_" + backend_id


def prefill_body(body: Mapping[str, Any], *, crossed: bool, request_id: str) -> bytes:
    """Leg 1: one output token, whole, not stored, holding the blocks when crossed."""
    sent = dict(body)
    sent["stream"] = False
    sent["store"] = False
    sent["max_output_tokens"] = 1
    sent["request_id"] = request_id
    sent.pop("kv_transfer_params", None)
    if crossed:
        sent["kv_transfer_params"] = prefill_request_params()
    return orjson.dumps(sent)


def decode_body(
    body: Mapping[str, Any], descriptor: bytes | None, *, request_id: str, stream: bool
) -> bytes:
    """Leg 2: the body with the producer's descriptor spliced in byte for byte."""
    sent = dict(body)
    sent["stream"] = stream
    sent["store"] = False
    sent["request_id"] = request_id
    sent.pop("kv_transfer_params", None)
    encoded = orjson.dumps(sent)
    if descriptor is None:
        return encoded
    return encoded[:-1] + b',"kv_transfer_params":' + descriptor + b"}"


class Kind(Enum):
    """What one Responses event means to the router."""

    OUTPUT = "output"
    OTHER = "other"
    ENDED = "ended"
    FAILED = "failed"
    ERROR = "error"


_ENDED = frozenset({"response.completed", "response.incomplete"})


class _Event(msgspec.Struct):
    """What the router reads of an event; the rest is checked to be JSON, not built."""

    type: str
    sequence_number: int | None = None


_EVENTS = msgspec.json.Decoder(_Event)


class EventError(ValueError):
    """An event that is not a Responses event (not a JSON object with a string `type`)."""


def kind_of(event_type: str) -> Kind:
    if event_type.endswith(".delta"):
        return Kind.OUTPUT
    if event_type in _ENDED:
        return Kind.ENDED
    if event_type == "response.failed":
        return Kind.FAILED
    if event_type == "error":
        return Kind.ERROR
    return Kind.OTHER


def read_event(data: bytes) -> tuple[Kind, int | None]:
    """An event's kind and sequence number; raises `EventError` for what is not an event."""
    try:
        event = _EVENTS.decode(data)
        if not data.isascii():
            data.decode()
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise EventError(f"stream event is not a Responses event: {exc}") from None
    return kind_of(event.type), event.sequence_number


def status_of(code: object) -> int | None:
    """The HTTP status an error's `code` carries: an integer, or digits in a string, in
    400..599; None for any other code."""
    if isinstance(code, bool):
        return None
    if isinstance(code, str) and code.isascii() and code.isdigit():
        code = int(code)
    return code if isinstance(code, int) and 400 <= code <= 599 else None


def failure_of(payload: Mapping[str, Any]) -> tuple[int, str, str | None]:
    """The status, message and param of an `error` or `response.failed` event: its code's
    status when it carries one, else 502."""
    source: Mapping[str, Any] = payload
    if payload.get("type") == "response.failed":
        response = payload.get("response")
        error = response.get("error") if isinstance(response, dict) else None
        source = error if isinstance(error, dict) else {}
    message = source.get("message")
    param = source.get("param")
    return (
        status_of(source.get("code")) or 502,
        message if isinstance(message, str) and message else "the engine reported a failure",
        param if isinstance(param, str) else None,
    )


def error_event(status: int, message: str, param: str | None, sequence_number: int) -> bytes:
    """The router's own terminal event on a committed Responses stream."""
    data = orjson.dumps(
        {
            "type": "error",
            "code": str(status),
            "message": message,
            "param": param,
            "sequence_number": sequence_number,
        }
    )
    return b"event: error\ndata: " + data + b"\n\n"
