"""What one continuable answer has given the client so far, kept cheaply.

While an answer streams, the router does no per-event parsing for continuation: `take`
keeps a reference to each block of engine bytes it relays (bounded by
`continuation.max_tracked_bytes`) and, unless the client asked for token ids itself,
splices the `token_ids` and `prompt_token_ids` lists it asked for to `null` by byte
search. Only when the consumer fails does `settle` read the kept bytes: the prompt's ids
P, the generated ids, and the committed boundary G (see `router.continuation`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Matches both `"token_ids":[...]` and `"prompt_token_ids":[...]`; inside a JSON string a
# quote is escaped, so the bytes cannot occur in text, and an id list holds no `]`.
_ID_LIST = re.compile(rb'token_ids":\[[^\]]*\]')
_NULL_IDS = b'token_ids":null'
_PROMPT_IDS = b'"prompt_token_ids":['
_EVENT_IDS = b'"token_ids":['


def strip_ids(block: bytes) -> bytes:
    """`block` with every token id list spliced to `null`, as an engine sends them unasked:
    one pass of compiled byte matching over the block, with no Python-level step per event."""
    return _ID_LIST.sub(_NULL_IDS, block)


@dataclass(slots=True)
class Progress:
    """One answer's relayed bytes, and once `settle`d, its ids and committed boundary."""

    chat: bool
    strip: bool
    max_tracked: int
    # Bytes of blocks still to be kept (`continuation.max_tracked_bytes` at first);
    # negative once they were too many, and then none are.
    room: int
    # Engine blocks relayed and not yet read, as the engine sent them.
    pending: list[bytes] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    # ids[:committed] have had all their text delivered.
    committed: int = 0
    finished: bool = False
    content_seen: bool = False
    reasoning_seen: bool = False
    # More ids (or bytes) than the bounds: none are kept, and the answer cannot continue.
    overflow: bool = False
    # The first event as sent, whose head (id, object, created, model) the rescue reuses.
    first_event: bytes | None = None

    def take(self, block: bytes) -> bytes:
        """Keep a block of whole events for later; return the bytes the client gets."""
        if self.room >= 0:
            self.pending.append(block)
            self.room -= len(block)
        return strip_ids(block) if self.strip else block

    def settle(self) -> None:
        """Read the kept blocks (after a failure): ids, the committed boundary, the finish."""
        pending, self.pending = self.pending, []
        if self.first_event is None and pending:
            first = pending[0]
            self.first_event = first[: first.find(b"\n\n") + 2]
        if self.room < 0:
            self._overflow()
            return
        for block in pending:
            start, size = 0, len(block)
            while start < size and not self.overflow:
                end = block.find(b"\n\n", start)
                end = size if end < 0 else end + 2
                self._event(block, start, end)
                start = end

    def _event(self, block: bytes, start: int, end: int) -> None:
        if self.prompt_ids is None:
            at = block.find(_PROMPT_IDS, start, end)
            if at >= 0:
                self.prompt_ids = _ints(block, at + len(_PROMPT_IDS), end)
        at = block.find(_EVENT_IDS, start, end)
        if at < 0:
            return
        self._note(_ints(block, at + len(_EVENT_IDS), end))
        if block.find(b'"finish_reason":null', start, end) < 0:
            self.finished = True
            self.committed = len(self.ids)
            return
        if self.chat:
            content = _has_text(block, b'"content":"', start, end)
            reasoning = _has_text(block, b'"reasoning":"', start, end) or _has_text(
                block, b'"reasoning_content":"', start, end
            )
            self.content_seen = self.content_seen or content
            self.reasoning_seen = self.reasoning_seen or reasoning
            has_text = content or reasoning
        else:
            has_text = block.find(b'"text":""', start, end) < 0
        if has_text:
            self.committed = len(self.ids)

    def _note(self, ids: list[int]) -> None:
        if self.overflow:
            return
        self.ids.extend(ids)
        if len(self.ids) > self.max_tracked:
            self._overflow()

    def _overflow(self) -> None:
        self.overflow = True
        self.ids = []
        self.pending = []

    def note_payload(self, choice: dict[str, Any], text: str) -> None:
        """Record a rescued event (already parsed): its ids, text and finish."""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self._note([token for token in ids if type(token) is int])
        if choice.get("finish_reason") is not None:
            self.finished = True
            self.committed = len(self.ids)
        elif text:
            self.committed = len(self.ids)
            self.content_seen = True

    @property
    def generated(self) -> list[int]:
        """G: the generated ids whose text the client has been given in full."""
        return self.ids[: self.committed]


def _ints(block: bytes, start: int, end: int) -> list[int]:
    close = block.find(b"]", start, end)
    raw = block[start:close] if close >= 0 else b""
    return [int(part) for part in raw.split(b",")] if raw else []


def _has_text(block: bytes, key: bytes, start: int, end: int) -> bool:
    at = block.find(key, start, end)
    return at >= 0 and block[at + len(key)] != 0x22
