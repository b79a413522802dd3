"""The producer's answer to a prefill: its descriptor, byte for byte, and the prompt's size.

The usual answer (one `kv_transfer_params` member, at the top) is read with one typed
parse that keeps the descriptor's own bytes and builds nothing else; any other layout is
located by scanning the document, as the rules below say.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.protocol.jsonspan import first_element_span, member_occurrences, member_spans

_NAME = b'"kv_transfer_params"'


class _Answer(msgspec.Struct):
    """What the router reads of a prefill answer; the rest is validated, not built."""

    choices: list[msgspec.Raw]
    usage: Any = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


class _Response(msgspec.Struct):
    """The same, of a Responses prefill answer (`/v1/responses`)."""

    output: list[msgspec.Raw]
    usage: Any = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


_ANSWERS = msgspec.json.Decoder(_Answer)
_RESPONSES = msgspec.json.Decoder(_Response)


def parse_prefill_answer(
    raw: bytes, engine: str, *, responses: bool = False
) -> tuple[bytes | None, int | None]:
    """The raw descriptor (None if null or absent) and the prompt's token count;
    `responses`: the answer is a Responses object (`/v1/responses`)."""
    try:
        answer: _Answer | _Response = (_RESPONSES if responses else _ANSWERS).decode(raw)
        # The typed parse skips what it does not build without checking its UTF-8.
        if not raw.isascii():
            raw.decode()
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise _not_a_completion(engine) from None
    usage = answer.usage
    counted = "input_tokens" if responses else "prompt_tokens"
    prompt_tokens = usage.get(counted) if isinstance(usage, dict) else None
    tokens = prompt_tokens if type(prompt_tokens) is int else None
    mentions = raw.count(_NAME)
    if mentions == 0:
        return None, tokens
    if mentions == 1 and answer.kv_transfer_params:
        descriptor = bytes(answer.kv_transfer_params)
        return (None if descriptor == b"null" else descriptor), tokens
    return _scanned_descriptor(raw), tokens


def _not_a_completion(engine: str) -> NarwhalError:
    return engine_error(
        Cause.BAD_RESPONSE,
        f"engine {engine} sent a prefill answer that is not a completion",
        engine,
    )


def _scanned_descriptor(raw: bytes) -> bytes | None:
    """Any layout: a lone member at any depth is the descriptor; of several, the top-level
    one wins over the first choice's."""
    found = member_occurrences(raw, "kv_transfer_params")
    if not found:
        return None
    if len(found) == 1:
        descriptor = raw[found[0][0] : found[0][1]]
        return None if descriptor == b"null" else descriptor
    spans = member_spans(raw)
    span = spans.get("kv_transfer_params")
    if span is None and "choices" in spans:
        # Some versions put it inside the first choice.
        choices = orjson.loads(raw)["choices"]
        first = first_element_span(raw, spans["choices"][0]) if choices else None
        if first is not None and isinstance(choices[0], dict):
            span = member_spans(raw, first[0]).get("kv_transfer_params")
    if span is None:
        return None
    descriptor = raw[span[0] : span[1]]
    return None if descriptor == b"null" else descriptor
