"""A decode leg asked for whole: the consumer's one non-streaming answer, kept as it came.

Only what the router decides on is read from it: that it is a JSON object, that it is not
an error object, and its usage (the prompt and output token counts). The bytes go to the
client unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.engines.leg_errors import error_object
from narwhal.protocol.errors import Cause, NarwhalError, engine_error


@dataclass(slots=True)
class WholeAnswer:
    """The consumer's answer: its body byte for byte, and the usage it reports."""

    engine: str
    body: bytes
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    # A leg the retry loop holds as it holds a stream; nothing is left open by now.
    async def __aenter__(self) -> WholeAnswer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


def parse_whole_answer(raw: bytes, engine: str) -> WholeAnswer:
    """The answer of a 200, checked; raises the engine's fault when it is not one."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(engine, f"is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise _bad(engine, "is not a JSON object")
    if "error" in payload or payload.get("object") == "error":
        raise error_object(payload, engine)
    usage = payload.get("usage")
    prompt = completion = None
    if isinstance(usage, dict):
        prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    return WholeAnswer(engine, raw, prompt, completion)


def _count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    return value if type(value) is int else None


def _bad(engine: str, why: str) -> NarwhalError:
    return engine_error(Cause.BAD_RESPONSE, f"engine {engine}'s decode answer {why}", engine)
