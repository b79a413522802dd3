"""Server-sent events, sans I/O: bytes in, complete events out, and what each event means.

The decoder keeps each event's raw bytes so the relay can forward them untouched; the
classifier parses JSON only when a decision needs it (before the first generated token,
for errors, and for the usage chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
import orjson

DONE = b"[DONE]"
DEFAULT_MAX_EVENT_BYTES = 1 << 20


class SseError(ValueError):
    """The byte stream is not a usable event stream (e.g. one event is too large)."""


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: `raw` as received (terminator included), `data` its payload."""

    raw: bytes
    data: bytes


class SseDecoder:
    """Incremental SSE decoder accepting LF, CR and CRLF line ends, split at any byte.

    Only `data:` fields matter to us; other fields and comments stay in `raw`. An event
    with no data line dispatches nothing (as the SSE spec says).
    """

    __slots__ = ("_buf", "_max", "_skip_lf")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self._max = max_event_bytes
        # An event ended by a CR at the very end of a chunk is dispatched at once; an LF
        # opening the next chunk is then the rest of that CRLF, not another blank line.
        self._skip_lf = False

    @property
    def pending(self) -> int:
        """Bytes held for an event not yet terminated."""
        return len(self._buf)

    @property
    def held(self) -> bytes:
        """The bytes held for events not yet taken."""
        return self._buf

    def feed(self, chunk: bytes, limit: int = 0) -> list[SseEvent]:
        """Complete events, in order; with `limit`, at most that many, the rest kept.

        A limit lets a reader look at events one at a time and leave the remainder
        buffered for `feed_plain`, instead of splitting a large chunk it will forward whole.
        """
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            events, rest = _split_general(buf, limit)
            if not rest and buf.endswith(b"\r"):
                self._skip_lf = True
        else:
            events, rest = _split_lf(buf, limit)
        if len(rest) > self._max and not (limit and len(events) == limit):
            raise SseError(f"an event exceeded {self._max} bytes without ending")
        self._buf = rest
        return events

    def feed_plain(self, chunk: bytes) -> bytes:
        """Fast path for relaying: take the chunk, return its leading plain events as one block.

        Plain means LF-framed `data: {...}` events, each one valid JSON object (UTF-8) with
        a non-empty `choices` list and no `error`, before `[DONE]`: events that need no
        decision. The whole block is checked by one typed parse of it as a JSON array
        that builds nothing but the `choices` lists, instead of per-event work. Returns b""
        when there are none. Whatever follows the block stays buffered: when `ready()`,
        the caller takes it with `feed(b"")`.
        """
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        self._buf = buf
        if b"\r" in buf:
            return b""
        # [DONE] ends a stream, so it can only be near the end of what has arrived.
        done = buf.find(b"data: [DONE]", max(0, len(buf) - 64))
        cut = buf.rfind(b"\n\n", 0, len(buf) if done < 0 else done) + 2
        if cut == 1 or not buf.startswith(b"data: {"):
            return b""
        end = _plain_end(buf[:cut])
        if end == 0:
            return b""
        self._buf = buf[end:]
        return buf[:end]

    def ready(self) -> bool:
        """Whether `feed(b"")` has something to do: a complete event, or an oversized one."""
        buf = self._buf
        return b"\n\n" in buf or b"\r" in buf or len(buf) > self._max


class _Chunk(msgspec.Struct):
    """What a relay decision reads of a chunk; every other member is validated, not built."""

    choices: list[msgspec.Raw] = []
    error: msgspec.Raw = msgspec.Raw()


_CHUNKS = msgspec.json.Decoder(list[_Chunk])
_SEPARATOR = b"\n\ndata: "


def _plain_end(block: bytes) -> int:
    """The end of the leading run of events that need no decision, in an LF-framed block.

    The block is parsed as one JSON array (JSON text holds no raw newline, so the
    separator only ever joins events); 0 when it is not such events, each one object.
    """
    if not block.endswith(b"\n\n"):
        return 0
    events = block[6:-2].split(_SEPARATOR)
    try:
        chunks = _CHUNKS.decode(b",".join(events).join((b"[", b"]")))
        if not block.isascii():
            block.decode()
    except (msgspec.DecodeError, UnicodeDecodeError):
        return 0
    # A value count that differs means an event held more than one JSON value.
    if len(chunks) != len(events):
        return 0
    for index, chunk in enumerate(chunks):
        if not chunk.choices or chunk.error:
            return _start_of_event(block, index, len(chunks))
    return len(block)


def _start_of_event(block: bytes, index: int, count: int) -> int:
    """Where event `index` of `count` begins; found from the end, as the events that need
    a decision (usage, [DONE]) come last."""
    if index == 0:
        return 0
    end = len(block) - 2
    for _ in range(count - index):
        end = block.rfind(b"\n\n", 0, end)
    return end + 2


def _split_lf(buf: bytes, limit: int = 0) -> tuple[list[SseEvent], bytes]:
    """Fast path for the usual `data: ...\\n\\n` framing."""
    events: list[SseEvent] = []
    start = 0
    while True:
        end = buf.find(b"\n\n", start)
        if end < 0 or (limit and len(events) == limit):
            return events, buf[start:]
        block = buf[start:end]
        if block.startswith(b"data: ") and b"\n" not in block:
            events.append(SseEvent(buf[start : end + 2], block[6:]))
        else:
            data = _data_of(block.split(b"\n"))
            if data is not None:
                events.append(SseEvent(buf[start : end + 2], data))
        start = end + 2


def _split_general(buf: bytes, limit: int = 0) -> tuple[list[SseEvent], bytes]:
    """Any mix of CR, LF and CRLF.

    A trailing CR after a non-empty line waits for a possible LF; one that ends an event
    (a blank line) dispatches it, since a following LF could only add another blank line.
    """
    events: list[SseEvent] = []
    lines: list[bytes] = []
    event_start = pos = 0
    size = len(buf)
    while pos < size and not (limit and len(events) == limit):
        lf = buf.find(b"\n", pos)
        cr = buf.find(b"\r", pos, lf if lf >= 0 else size)
        if cr >= 0:
            if cr + 1 < size:
                line_end, next_pos = cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            elif cr == pos:
                line_end, next_pos = cr, cr + 1
            else:
                break  # CR at the end of a line: maybe half of a CRLF.
        elif lf >= 0:
            line_end, next_pos = lf, lf + 1
        else:
            break
        line = buf[pos:line_end]
        pos = next_pos
        if line:
            lines.append(line)
            continue
        data = _data_of(lines)
        if data is not None:
            events.append(SseEvent(buf[event_start:pos], data))
        lines = []
        event_start = pos
    return events, buf[event_start:]


def _data_of(lines: list[bytes]) -> bytes | None:
    parts: list[bytes] = []
    for line in lines:
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            parts.append(b"")
    return b"\n".join(parts) if parts else None


class EventKind(Enum):
    OUTPUT = "output"
    METADATA = "metadata"
    USAGE = "usage"
    ERROR = "error"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Classified:
    kind: EventKind
    payload: dict[str, Any] | None = None


_METADATA = Classified(EventKind.METADATA)
_DONE = Classified(EventKind.DONE)


def classify(data: bytes) -> Classified:
    """Parse one event payload fully and say what it is.

    Raises `SseError` for a payload that is neither `[DONE]` nor a JSON object.
    """
    if data == DONE:
        return _DONE
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SseError(f"stream event is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise SseError("stream event is not a JSON object")
    if "error" in payload or payload.get("object") == "error":
        return Classified(EventKind.ERROR, payload)
    choices = payload.get("choices")
    if not isinstance(choices, list):
        raise SseError("stream event has no `choices` list")
    if not choices:
        return Classified(EventKind.USAGE, payload) if "usage" in payload else _METADATA
    if reports_tokens(choices[0]):
        return Classified(EventKind.OUTPUT, payload)
    return Classified(EventKind.METADATA, payload)


def classify_after_first_output(data: bytes) -> Classified | None:
    """Once output has started: None means "forward it, nothing to decide".

    Only `[DONE]`, error objects and usage chunks need a decision, recognised by a byte
    scan before anything is parsed (in JSON text a generated `"error"` is always escaped,
    so the scan cannot mistake model output for an error). Every other event must still
    be a JSON object, so garbage is never relayed as a token. Plain runs of events skip
    this per-event path altogether (`SseDecoder.feed_plain`).
    """
    if data == DONE:
        return _DONE
    if b'"error"' in data or b'"usage"' in data:
        return classify(data)
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SseError(f"stream event is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise SseError("stream event is not a JSON object")
    return None


def reports_tokens(choice: object) -> bool:
    """Whether a chunk's choice reports tokens the engine generated, whatever their text.

    vLLM sends a choice only for an engine step that produced tokens (it skips steps
    without any), so a choice is output even when its text is "" (a skipped special
    token, part of a multi-byte character) or its delta is empty (a parser holding text
    back while logprobs or token ids go out). The one exception opens every chat stream:
    the role announcement, a delta with `role` and nothing else of substance, sent before
    the first token. A choice that is not an object reports nothing.
    """
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return True
    if choice.get("finish_reason") is not None:
        return True
    return any(value for key, value in delta.items() if key != "role")


def error_status(payload: dict[str, Any]) -> tuple[int, str]:
    """The HTTP status and message of an error object (newer and older vLLM shapes)."""
    inner = payload.get("error")
    source = inner if isinstance(inner, dict) else payload
    code = source.get("code")
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500
    if not 400 <= status <= 599:
        status = 500
    message = source.get("message")
    if not isinstance(message, str):
        message = inner if isinstance(inner, str) else "engine reported an error"
    return status, message


def error_detail(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The error object itself, in the newer shape's members (`message`, `type`, `param`,
    `code`, and any others the engine added); None when there is no message to show."""
    inner = payload.get("error")
    if isinstance(inner, dict):
        detail = inner
    else:
        detail = {key: value for key, value in payload.items() if key != "object"}
    return detail if isinstance(detail.get("message"), str) else None


def block_payloads(block: bytes) -> list[dict[str, Any]]:
    """The payloads of a block of whole events, each a JSON object; `[DONE]` is skipped.

    A plain block (LF-framed `data: {...}` events) is parsed with a single call; anything
    else is decoded event by event. Raises `SseError` for an event that is not a JSON
    object.
    """
    if block.startswith(b"data: {") and block.endswith(b"}\n\n") and b"\r" not in block:
        inner = block[6:-2]
        array = inner.replace(_SEPARATOR, b",")
        try:
            items = orjson.loads(b"[" + array + b"]")
        except orjson.JSONDecodeError:
            items = None
        events = (len(inner) - len(array)) // (len(_SEPARATOR) - 1) + 1
        if (
            isinstance(items, list)
            and len(items) == events
            and all(isinstance(item, dict) for item in items)
        ):
            return items
    payloads = []
    for event in SseDecoder().feed(block):
        if event.data == DONE:
            continue
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError as exc:
            raise SseError(f"stream event is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise SseError("stream event is not a JSON object")
        payloads.append(payload)
    return payloads
