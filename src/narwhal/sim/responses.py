"""Response bodies: the SSE events of a stream and the non-streaming objects.

A stream's chunks differ only in their text, so each `StreamEncoder` encodes the fixed parts
once and a token's event is three byte strings joined; vocabulary words are pre-encoded.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from narwhal.sim.api import Route
from narwhal.sim.model import VOCAB

DONE = b"data: [DONE]\n\n"

_ENCODED_WORDS = {word: orjson.dumps(word) for word in VOCAB}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def event(payload: Mapping[str, object]) -> bytes:
    """One SSE event carrying a JSON object."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class StreamEncoder:
    """Encodes the chunks of one stream (completions or chat) exactly as vLLM shapes them."""

    def __init__(self, route: Route, response_id: str, created: int, model: str) -> None:
        self._chat = route == "chat"
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": created,
            "model": model,
        }
        open_head = b"data: " + orjson.dumps(self._head)[:-1] + b',"choices":[{"index":0,'
        if self._chat:
            self._before_text = open_head + b'"delta":{"content":'
            self._between = b"},"
        else:
            self._before_text = open_head + b'"text":'
            self._between = b","
        self._after_text = self._between + b'"logprobs":null,"finish_reason":null}]}\n\n'

    def token(self, text: str) -> bytes:
        """A chunk carrying generated text."""
        encoded = _ENCODED_WORDS.get(text) or orjson.dumps(text)
        return self._before_text + encoded + self._after_text

    def last_token(self, text: str, finish_reason: str) -> bytes:
        """The chunk that carries the final text and the finish reason."""
        return self._chunk(self._delta(text), finish_reason)

    def role(self) -> bytes:
        """The chat stream's first chunk, before any generated output."""
        return self._chunk({"role": "assistant", "content": ""}, None)

    def metadata(self) -> bytes:
        """A chunk without generated output, as engines send while busy."""
        return self._chunk({} if self._chat else {"text": ""}, None)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return event(self._head | {"choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    def _delta(self, text: str) -> dict[str, object]:
        return {"content": text} if self._chat else {"text": text}

    def _chunk(self, fields: dict[str, object], finish_reason: str | None) -> bytes:
        choice: dict[str, object] = {"index": 0}
        if self._chat:
            choice["delta"] = fields
        else:
            choice.update(fields)
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return event(self._head | {"choices": [choice]})


def completion(
    route: Route,
    response_id: str,
    created: int,
    model: str,
    *,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, object]:
    """The non-streaming completions or chat object."""
    choice: dict[str, object] = {"index": 0}
    if route == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    return {
        "id": response_id,
        "object": "chat.completion" if route == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }
