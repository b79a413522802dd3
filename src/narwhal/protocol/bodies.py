"""Client request bodies in, the two legs' bodies out (docs/engine-contract.md, legs 1 and 2).

The client's body is parsed once and checked only for what the router itself relies on;
the engines validate the rest and their 400s are relayed to the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.protocol.errors import client_error
from narwhal.protocol.responses import Ask, check_responses_body


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"


# Fields a one-token prefill must not carry (vLLM answers 400 to them without streaming).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client call; `body` never holds client-provided `kv_transfer_params`."""

    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    # A Responses request's own asks (storing, the conversation it follows); None on the
    # other routes.
    ask: Ask | None = None

    @property
    def max_tokens(self) -> int | None:
        body = self.body
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is None:
            value = body.get("max_output_tokens")
        return value if isinstance(value, int) else None


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(_is_int(token) for token in prompt):
            return
        if len(prompt) == 1 and (
            isinstance(prompt[0], str)
            or (isinstance(prompt[0], list) and prompt[0] and all(_is_int(t) for t in prompt[0]))
        ):
            return
        if len(prompt) > 1 and all(isinstance(item, str | list) for item in prompt):
            raise client_error(
                400,
                f"`prompt` holds {len(prompt)} prompts; send one prompt per request "
                "(each prompt needs its own prefill/decode handoff)",
            )
    raise client_error(
        400,
        "`prompt` must be a string, a non-empty list of token ids, or a list with one of these",
    )


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise client_error(400, "`messages` must be a non-empty list of message objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise client_error(400, f"`messages[{index}]` must be an object with a string `role`")


def _check_single_choice(body: dict[str, Any], field: str) -> None:
    value = body.get(field)
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise client_error(400, f"`{field}` must be a positive integer, got {value!r}")
    if value > 1:
        raise client_error(
            400,
            f"`{field}` > 1 is not supported: the prefill leg generates exactly one "
            f"sequence (got {field}={value})",
        )


def parse_client_request(endpoint: Endpoint, raw: bytes, model: str) -> ClientRequest:
    """Parse and check a client body; raises a 400 `NarwhalError` naming the problem.
    `model`: the default model, for a body that names none."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise client_error(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise client_error(400, "request body must be a JSON object")
    requested = body.get("model", model)
    if not isinstance(requested, str):
        raise client_error(400, "`model` must be a string")
    # Which pool the name stands for is placement's to say (`fleet.models`).
    body["model"] = requested
    if endpoint is Endpoint.RESPONSES:
        return _responses_request(body)
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise client_error(400, "`prompt` is required")
        _check_prompt(body["prompt"])
    else:
        _check_messages(body.get("messages"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise client_error(400, "`stream` must be a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise client_error(400, "`stream_options` must be an object", "stream_options")
    if options and not stream:
        # vLLM refuses it too: the answer would differ with and without the router.
        raise client_error(
            400,
            "`stream_options` can only be set when `stream` is true",
            "stream_options",
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not _is_int(value) or value < 1):
            raise client_error(400, f"`{field}` must be a positive integer, got {value!r}")
    _check_single_choice(body, "n")
    _check_single_choice(body, "best_of")
    body.pop("kv_transfer_params", None)
    include_usage = bool(stream and options and options.get("include_usage"))
    return ClientRequest(endpoint, body, stream, include_usage)


def _responses_request(body: dict[str, Any]) -> ClientRequest:
    ask = check_responses_body(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise client_error(400, "`stream` must be a boolean", "stream")
    return ClientRequest(Endpoint.RESPONSES, body, stream, False, ask)


def prefill_body(client_body: Mapping[str, Any], *, crossed: bool) -> bytes:
    """Leg 1: the client's body as a one-token, non-streaming prefill.

    Only a crossed handoff asks the producer to hold blocks; a same-worker prefill just
    warms the engine's prefix cache for the plain decode that follows.
    """
    body = dict(client_body)
    body.pop("kv_transfer_params", None)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for field in _PREFILL_DROPPED:
        body.pop(field, None)
    if crossed:
        body["kv_transfer_params"] = prefill_request_params()
    return orjson.dumps(body)


def decode_body(client_body: Mapping[str, Any], descriptor: bytes | None) -> bytes:
    """Leg 2: the client's body, streaming, with usage reported and the descriptor spliced in.

    `descriptor` is the producer's raw JSON, inserted byte-for-byte. Usage is always
    requested so the router knows the output token count; the usage chunk is dropped on
    the way out when the client did not ask for it.
    """
    body = dict(client_body)
    body.pop("kv_transfer_params", None)
    body["stream"] = True
    options = body.get("stream_options")
    body["stream_options"] = {**(options or {}), "include_usage": True}
    encoded = orjson.dumps(body)
    if descriptor is None:
        return encoded
    return encoded[:-1] + b',"kv_transfer_params":' + descriptor + b"}"


def whole_decode_body(client_body: Mapping[str, Any], descriptor: bytes | None) -> bytes:
    """Leg 2 asked for whole (`engine.nonstream_decode = "whole"`): the client's body,
    non-streaming, with the descriptor spliced in byte-for-byte. A non-streaming answer
    always carries its usage, so nothing else is asked for."""
    body = dict(client_body)
    body.pop("kv_transfer_params", None)
    body.pop("stream_options", None)
    body["stream"] = False
    encoded = orjson.dumps(body)
    if descriptor is None:
        return encoded
    return encoded[:-1] + b',"kv_transfer_params":' + descriptor + b"}"
