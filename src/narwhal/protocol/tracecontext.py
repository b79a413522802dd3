"""W3C Trace Context headers (`traceparent`, `tracestate`): checked, read and written.

The router passes a client's trace context on to both engine legs whether or not it traces
itself, so this module has no tracing library behind it: the pass-through costs a header
lookup and one pattern match per request.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# version-traceid-parentid-flags, lowercase hex; later versions may append "-" and more.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
# The spec asks that at least 512 characters of tracestate be passed on; longer lists may be
# cut, and here they are dropped whole rather than cut mid-entry.
MAX_TRACESTATE = 512


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    flags: int


def _fields(value: str) -> tuple[str, ...] | None:
    """The fields of a valid `traceparent` as text (version, trace id, span id, flags)."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return version, trace_id, span_id, flags


def parse_traceparent(value: str) -> TraceParent | None:
    """The ids and flags of a valid `traceparent`, or None (the header is then ignored)."""
    fields = _fields(value)
    if fields is None:
        return None
    return TraceParent(int(fields[1], 16), int(fields[2], 16), int(fields[3], 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """A version-00 `traceparent` naming `span_id` as the parent of what receives it."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def usable_tracestate(value: str | None) -> str | None:
    """The `tracestate` to pass on: within the size bound and printable ASCII, else None."""
    if not value or len(value) > MAX_TRACESTATE or not value.isascii() or not value.isprintable():
        return None
    return value


def header_lines(traceparent: str, tracestate: str | None) -> bytes:
    """Pre-encoded header lines for an engine request (`Name: value\\r\\n` each)."""
    lines = f"traceparent: {traceparent}\r\n"
    if tracestate:
        lines += f"tracestate: {tracestate}\r\n"
    return lines.encode("ascii")


def passthrough(traceparent: str | None, tracestate: str | None) -> bytes:
    """The client's own context for the engine legs, unchanged; b"" when it has none valid.

    A `tracestate` without a valid `traceparent` means nothing, so it is dropped with it.
    """
    if traceparent is None or _fields(traceparent) is None:
        return b""
    return header_lines(traceparent, usable_tracestate(tracestate))
