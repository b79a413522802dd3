"""The usual non-streaming answer in one typed pass over the stream's bytes.

vLLM streams the same few members in every chunk. When every event is such a chunk (the
members below, of these types, and nothing else), the answer is built from one typed parse
of all the events at once: texts joined, any other member the last non-null one sent, as
`Assembler` folds them member by member. A stream with anything else (logprobs, token ids,
tool calls, members the router does not know) gets None here and is folded by `Assembler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any, TypeVar

import msgspec
import orjson
from msgspec import UNSET, UnsetType

from narwhal.protocol.bodies import Endpoint


class _CompletionChoice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: int | None = None
    text: str | None = None
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: None = None
    token_ids: None = None


class _CompletionChunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[_CompletionChoice] = []
    usage: dict[str, Any] | None = None
    system_fingerprint: str | None = None


class _Delta(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    # Absent and null differ here: a delta with a `role` may be the role announcement.
    role: str | UnsetType | None = UNSET
    content: str | None = None
    reasoning: str | None = None


class _ChatChoice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: int | None = None
    delta: _Delta | None = None
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: None = None


class _ChatChunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[_ChatChoice] = []
    usage: dict[str, Any] | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: None = None
    prompt_text: None = None


_Chunk = TypeVar("_Chunk", _CompletionChunk, _ChatChunk)
_AnyChunk = _CompletionChunk | _ChatChunk
_COMPLETION_CHUNKS = msgspec.json.Decoder(list[_CompletionChunk])
_CHAT_CHUNKS = msgspec.json.Decoder(list[_ChatChunk])
_SEPARATOR = b"\n\ndata: "
_USAGE_MISSING = {"prompt_tokens_details": None, "completion_tokens_details": None}


def typed_answer(
    endpoint: Endpoint,
    block: bytes,
    usage_chunk: dict[str, Any] | None,
    usage: dict[str, Any] | None,
) -> tuple[bytes, dict[str, Any] | None] | None:
    """The answer's JSON and its usage, or None when the stream is not of the usual shape.

    `block` is the stream's forwarded events; `usage_chunk` the usage chunk held back from
    them (folded last); `usage` the stream's usage when it had a usage chunk.
    """
    if endpoint is Endpoint.CHAT:
        chat = _chunks(block, usage_chunk, _CHAT_CHUNKS, _ChatChunk)
        return None if chat is None else _finished(_chat(chat), usage, chat)
    completion = _chunks(block, usage_chunk, _COMPLETION_CHUNKS, _CompletionChunk)
    return None if completion is None else _finished(_completion(completion), usage, completion)


def _finished(
    answer: dict[str, Any], usage: dict[str, Any] | None, chunks: Sequence[_AnyChunk]
) -> tuple[bytes, dict[str, Any] | None] | None:
    """The answer's JSON with its usage: the stream's, else the last one a chunk carried."""
    if usage is None:
        usage = _latest(chunks, "usage")
    answer["usage"] = None if usage is None else {**usage, **_missing(usage)}
    try:
        return orjson.dumps(answer), usage
    except TypeError:
        # A value orjson cannot write (an integer past 64 bits); the general path decides.
        return None


def gathered_answer(
    endpoint: Endpoint, events: bytes
) -> tuple[bytes, dict[str, Any] | None] | None:
    """The answer from a whole stream's events, undecided (`DecodeStream.rest`), or None.

    This one parse is also their check: it succeeds only when every event is a chunk of
    the usual shape, and only the last may be without choices (the usage chunk, whose
    usage is the answer's). Anything else gets None and the stream decides its events.
    """
    if endpoint is Endpoint.CHAT:
        chat = _chunks(events, None, _CHAT_CHUNKS, _ChatChunk)
        if chat is None or not _choices_before_last(chat):
            return None
        return _finished(_chat(chat), None if chat[-1].choices else chat[-1].usage, chat)
    completion = _chunks(events, None, _COMPLETION_CHUNKS, _CompletionChunk)
    if completion is None or not _choices_before_last(completion):
        return None
    last_usage = None if completion[-1].choices else completion[-1].usage
    return _finished(_completion(completion), last_usage, completion)


def _chunks(
    block: bytes,
    usage_chunk: dict[str, Any] | None,
    decoder: msgspec.json.Decoder[list[_Chunk]],
    kind: type[_Chunk],
) -> list[_Chunk] | None:
    """Every event of an LF-framed block of `data: {...}` events, in one parse, then the
    held-back usage chunk; None when any of them is not of the usual shape."""
    if not (block.startswith(b"data: {") and block.endswith(b"}\n\n")) or b"\r" in block:
        return None
    events = block[6:-2].split(_SEPARATOR)
    try:
        chunks = decoder.decode(b",".join(events).join((b"[", b"]")))
        if usage_chunk is not None:
            chunks.append(msgspec.convert(usage_chunk, kind))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    # A value count that differs means an event held something other than one JSON object.
    if len(chunks) != len(events) + (usage_chunk is not None):
        return None
    return chunks


def _completion(chunks: list[_CompletionChunk]) -> dict[str, Any]:
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    index = _latest(choices, "index")
    choice = {
        "index": 0 if index is None else index,
        "text": "".join([choice.text for choice in choices if choice.text is not None]),
        "logprobs": None,
        "finish_reason": _latest(choices, "finish_reason"),
        "stop_reason": _latest(choices, "stop_reason"),
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": _latest(chunks, "id"),
        "object": "text_completion",
        "created": _latest(chunks, "created"),
        "model": _latest(chunks, "model"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": _latest(chunks, "system_fingerprint"),
        "usage": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _chat(chunks: list[_ChatChunk]) -> dict[str, Any]:
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    index = _latest(choices, "index")
    finish = _latest(choices, "finish_reason")
    choice = {
        "index": 0 if index is None else index,
        "message": _message(choices),
        "logprobs": None,
        "finish_reason": "stop" if finish is None else finish,
        "stop_reason": _latest(choices, "stop_reason"),
        "token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": _latest(chunks, "id"),
        "object": "chat.completion",
        "created": _latest(chunks, "created"),
        "model": _latest(chunks, "model"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": _latest(chunks, "system_fingerprint"),
        "usage": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _message(choices: list[_ChatChoice]) -> dict[str, Any]:
    """The deltas folded; a role announcement adds its role and nothing else."""
    deltas = [choice.delta for choice in choices if choice.delta is not None]
    roles = [delta.role for delta in deltas if not isinstance(delta.role, UnsetType)]
    if roles:
        deltas = [
            delta
            for choice in choices
            if (delta := choice.delta) is not None
            and (isinstance(delta.role, UnsetType) or _reports_tokens(choice, delta))
        ]
    contents = [delta.content for delta in deltas if delta.content is not None]
    reasoning = [delta.reasoning for delta in deltas if delta.reasoning is not None]
    role = _last(roles)
    return {
        "role": "assistant" if role is None else role,
        "content": "".join(contents) if contents else None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": "".join(reasoning) if reasoning else None,
    }


def _reports_tokens(choice: _ChatChoice, delta: _Delta) -> bool:
    """`sse.reports_tokens` for a choice whose delta has a role."""
    return choice.finish_reason is not None or bool(delta.content) or bool(delta.reasoning)


def _last(values: list[Any]) -> Any:
    """The last non-null value, as `Assembler` keeps a member that is not text."""
    for value in reversed(values):
        if value is not None:
            return value
    return None


def _latest(items: Sequence[Any], member: str) -> Any:
    """`_last` of one member of `items`, read from the end (where it almost always is)
    rather than gathered from all of them."""
    for item in reversed(items):
        value = getattr(item, member)
        if value is not None:
            return value
    return None


def _choices_before_last(chunks: Sequence[_AnyChunk]) -> bool:
    """Whether every chunk but the last has choices (only the usage chunk may have none)."""
    return all(chunk.choices for chunk in islice(chunks, max(len(chunks) - 1, 0)))


def _missing(usage: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in _USAGE_MISSING.items() if key not in usage}
