"""The producer's answer to a prefill: its descriptor, byte for byte, and the prompt's size."""

from __future__ import annotations

import orjson

from narwhal.protocol.errors import Cause, engine_error
from narwhal.protocol.jsonspan import first_element_span, member_occurrences, member_spans


def parse_prefill_answer(raw: bytes, engine: str) -> tuple[bytes | None, int | None]:
    """The raw descriptor (None if null or absent) and the prompt's token count."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise engine_error(
            Cause.BAD_RESPONSE,
            f"engine {engine} sent a prefill answer that is not a completion",
            engine,
        )
    usage = answer.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    tokens = prompt_tokens if type(prompt_tokens) is int else None
    found = member_occurrences(raw, "kv_transfer_params")
    if not found:
        return None, tokens
    if len(found) == 1:
        descriptor = raw[found[0][0] : found[0][1]]
        return (None if descriptor == b"null" else descriptor), tokens
    # More than one: the top-level one wins over the first choice's.
    spans = member_spans(raw)
    span = spans.get("kv_transfer_params")
    if span is None and answer["choices"]:
        # Some versions put it inside the first choice.
        first = first_element_span(raw, spans["choices"][0])
        if first is not None and isinstance(answer["choices"][0], dict):
            span = member_spans(raw, first[0]).get("kv_transfer_params")
    if span is None:
        return None, tokens
    descriptor = raw[span[0] : span[1]]
    return (None if descriptor == b"null" else descriptor), tokens
