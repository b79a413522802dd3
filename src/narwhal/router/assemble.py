"""Non-streaming answers: the decode leg always streams, so the router builds the final object.

The object is shaped as vLLM 0.32 answers the same request without streaming (its
`CompletionResponse` / `ChatCompletionResponse`, every member present), filled from what
the stream carried. Nothing the engine sent is lost: a member the stream had is kept,
unknown ones included, whatever its name.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.sse import block_payloads, reports_tokens
from narwhal.router.assemble_typed import typed_answer

# vLLM 0.32's non-streaming members in its order, with their values when the stream
# never carried them. The stream carries the rest (ids, text, finish and usage).
_COMPLETION_TOP: dict[str, Any] = {
    "id": None,
    "object": "text_completion",
    "created": None,
    "model": None,
    "choices": None,
    "service_tier": None,
    "system_fingerprint": None,
    "usage": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_CHAT_TOP: dict[str, Any] = {
    "id": None,
    "object": "chat.completion",
    "created": None,
    "model": None,
    "choices": None,
    "service_tier": None,
    "system_fingerprint": None,
    "usage": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "prompt_text": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_COMPLETION_CHOICE: dict[str, Any] = {
    "index": 0,
    "text": "",
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "token_ids": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "routed_experts": None,
}
_CHAT_CHOICE: dict[str, Any] = {
    "index": 0,
    "message": None,
    "logprobs": None,
    "finish_reason": "stop",
    "stop_reason": None,
    "token_ids": None,
    "routed_experts": None,
}
_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
}
_USAGE: dict[str, Any] = {"prompt_tokens_details": None, "completion_tokens_details": None}
# Older engines name reasoning `reasoning_content`; only one of the two is filled in.
_REASONING_NAMES = ("reasoning", "reasoning_content")
# Members that are pieces of one text: concatenated, and left out when not a string.
_TEXTS = frozenset({"text", "content", "refusal", *_REASONING_NAMES})
# Members folded separately: the choices and deltas below a chunk, and its usage.
_NOT_MERGED = frozenset({"object", "choices", "usage", "delta", "tool_calls"})


def answer_body(
    endpoint: Endpoint,
    block: bytes,
    usage_chunk: dict[str, Any] | None,
    usage: dict[str, Any] | None,
) -> tuple[bytes, dict[str, Any] | None]:
    """The answer's JSON and its usage, from a finished stream's forwarded events (`block`),
    the usage chunk held back from them if any, and the stream's usage if it had one.

    The usual stream is read in one typed pass (`assemble_typed`); any other is parsed
    event by event and folded by `Assembler`. Raises `SseError` for an event that is not a
    JSON object.
    """
    typed = typed_answer(endpoint, block, usage_chunk, usage)
    if typed is not None:
        return typed
    assembler = Assembler(endpoint)
    for payload in block_payloads(block):
        assembler.add(payload)
    if usage_chunk is not None:
        assembler.add(usage_chunk)
    if usage is not None:
        assembler.usage = usage
    return orjson.dumps(assembler.result()), assembler.usage


class Assembler:
    """Folds decode chunks into one completion or chat completion object.

    Strings are concatenated (text, content, reasoning and any other text member);
    lists are extended (token ids, logprobs entries); tool-call deltas are merged by
    their index; any other value is the last non-null one sent. A member of the wrong
    type for its kind is left out rather than guessed at.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.usage: dict[str, Any] | None = None
        self._top: dict[str, Any] = {}
        self._choice: dict[str, Any] = {}
        self._message: dict[str, Any] = {}
        self._tool_calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        _merge(self._top, chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        _merge(self._choice, choice)
        delta = choice.get("delta")
        if self.endpoint is not Endpoint.CHAT or not isinstance(delta, dict):
            return
        if not reports_tokens(choice):
            # The role announcement's empty content is no part of the answer: a reply of
            # tool calls alone has null content, as vLLM answers it without streaming.
            delta = {"role": delta["role"]}
        _merge(self._message, delta, any_text=True)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._merge_tool_call(call)

    def _merge_tool_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._tool_calls))
        call = self._tool_calls.setdefault(
            index if isinstance(index, int) else 0,
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function")
        if isinstance(function, dict):
            for field in ("name", "arguments"):
                if isinstance(function.get(field), str):
                    call["function"][field] += function[field]

    def result(self) -> dict[str, Any]:
        chat = self.endpoint is Endpoint.CHAT
        choice = _shaped(_CHAT_CHOICE if chat else _COMPLETION_CHOICE, self._choice)
        if chat:
            choice["message"] = self._assembled_message()
        answer = _shaped(_CHAT_TOP if chat else _COMPLETION_TOP, self._top)
        answer["choices"] = [choice]
        answer["usage"] = None if self.usage is None else {**self.usage, **_missing(self.usage)}
        return answer

    def _assembled_message(self) -> dict[str, Any]:
        message = _shaped(_MESSAGE, self._message)
        if not any(name in message for name in _REASONING_NAMES):
            message["reasoning"] = None
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        return message


def _merge(into: dict[str, Any], part: dict[str, Any], *, any_text: bool = False) -> None:
    """Fold one chunk's (or choice's, or delta's) members into what came before.

    With `any_text` (a delta), every string member but `role` is a piece of text.
    """
    for key, value in part.items():
        if key in _NOT_MERGED or value is None:
            continue
        seen = into.get(key)
        if key in _TEXTS or (any_text and isinstance(value, str) and key != "role"):
            if isinstance(value, str):
                into[key] = seen + value if isinstance(seen, str) else value
        elif isinstance(value, list):
            if isinstance(seen, list):
                seen.extend(value)
            else:
                into[key] = list(value)
        elif key == "logprobs" and isinstance(value, dict):
            if not isinstance(seen, dict):
                into[key] = seen = {}
            _merge_lists(seen, value)
        else:
            into[key] = value


def _merge_lists(into: dict[str, Any], part: dict[str, Any]) -> None:
    """Logprobs: each list (per token entries) extended, any other member the last sent."""
    for key, value in part.items():
        seen = into.get(key)
        if isinstance(seen, list) and isinstance(value, list):
            seen.extend(value)
        elif value is not None:
            into[key] = list(value) if isinstance(value, list) else value


def _shaped(template: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """The template's members in its order, the merged values over its defaults (a value
    of another JSON type than a string default is left out), then any other member."""
    shaped: dict[str, Any] = {}
    for key, default in template.items():
        value = merged.get(key, default)
        if isinstance(default, str) and not isinstance(value, str):
            value = default
        shaped[key] = value
    shaped.update((key, value) for key, value in merged.items() if key not in template)
    return shaped


def _missing(usage: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in _USAGE.items() if key not in usage}
