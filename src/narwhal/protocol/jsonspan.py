"""Locate a member's raw bytes inside a JSON document without re-encoding anything.

The descriptor must reach the consumer byte-for-byte as the producer wrote it, so the
router splices the producer's own bytes rather than a re-serialised copy. The document is
assumed to be valid JSON (it was parsed first); these helpers only find boundaries.
"""

from __future__ import annotations

import re

import orjson

# One lexical step: a whole string, or one structural character.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\],:]', re.DOTALL)
_WS = b" \t\r\n"


def _value_end(doc: bytes, start: int) -> int:
    """Index just past the JSON value starting at `start` (after whitespace)."""
    first = doc[start : start + 1]
    if first == b'"':
        match = _TOKEN.match(doc, start)
        assert match is not None
        return match.end()
    if first in (b"{", b"["):
        depth = 0
        for match in _TOKEN.finditer(doc, start):
            token = match.group()
            if token in (b"{", b"["):
                depth += 1
            elif token in (b"}", b"]"):
                depth -= 1
                if depth == 0:
                    return match.end()
        raise ValueError("unterminated JSON container")
    # A number, true, false or null: runs until a delimiter.
    end = start
    while end < len(doc) and doc[end : end + 1] not in b",}] \t\r\n":
        end += 1
    return end


def _skip_ws(doc: bytes, pos: int) -> int:
    while pos < len(doc) and doc[pos] in _WS:
        pos += 1
    return pos


def member_spans(doc: bytes, start: int = 0) -> dict[str, tuple[int, int]]:
    """Spans of each member value of the object starting at `start`, by (unescaped) key."""
    pos = _skip_ws(doc, start)
    if doc[pos : pos + 1] != b"{":
        raise ValueError("not a JSON object")
    spans: dict[str, tuple[int, int]] = {}
    pos = _skip_ws(doc, pos + 1)
    if doc[pos : pos + 1] == b"}":
        return spans
    while True:
        key_end = _value_end(doc, pos)
        key = orjson.loads(doc[pos:key_end])
        pos = _skip_ws(doc, key_end)
        pos = _skip_ws(doc, pos + 1)  # past ':'
        value_end = _value_end(doc, pos)
        spans[key] = (pos, value_end)
        pos = _skip_ws(doc, value_end)
        if doc[pos : pos + 1] != b",":
            return spans
        pos = _skip_ws(doc, pos + 1)


def first_element_span(doc: bytes, start: int) -> tuple[int, int] | None:
    """Span of the first element of the array starting at `start`, or None if empty."""
    pos = _skip_ws(doc, start)
    if doc[pos : pos + 1] != b"[":
        raise ValueError("not a JSON array")
    pos = _skip_ws(doc, pos + 1)
    if doc[pos : pos + 1] == b"]":
        return None
    return pos, _value_end(doc, pos)


def member_occurrences(doc: bytes, key: str) -> list[tuple[int, int]]:
    """Spans of the values of every member named `key`, at any depth, in one scan.

    A quoted name followed by a colon can only be a member name: inside a JSON string its
    quotes would be escaped.
    """
    name = b'"' + key.encode() + b'"'
    spans = []
    at = doc.find(name)
    while at >= 0:
        pos = _skip_ws(doc, at + len(name))
        if doc[pos : pos + 1] == b":":
            start = _skip_ws(doc, pos + 1)
            spans.append((start, _value_end(doc, start)))
        at = doc.find(name, at + len(name))
    return spans
