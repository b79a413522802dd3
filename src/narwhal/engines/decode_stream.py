"""A decode leg past its first token: engine bytes relayed as they come, failures raised.

`EngineClient.send_decode` opens the leg and watches it up to the first generated token;
from there a `DecodeStream` owns the connection until the stream ends or is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Self, TypeVar

from narwhal.engines.gaps import TokenGaps
from narwhal.engines.http import HIGH_WATER, Connection, HttpError
from narwhal.engines.leg_errors import bad_stream, error_object
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.protocol.sse import (
    EventKind,
    SseDecoder,
    SseError,
    SseEvent,
    classify,
    classify_after_first_output,
)
from narwhal.runtime.clock import Clock, clock

T = TypeVar("T")
# How the usual stream ends, LF-framed; its `[DONE]` wakes a bulk read.
_DONE_EVENT = b"\n\ndata: [DONE]\n\n"
_DONE_MARK = b"[DONE]"
# A bulk read wakes for either: the end of the stream, or an error object to act on at once
# (an engine that sends one may then hold the connection open).
_BULK_MARKS = (_DONE_MARK, b'"error"')


class DecodeStream:
    """An open decode leg past its first token: engine bytes out, failures raised.

    Iterating yields the bytes to forward: whole events exactly as the engine sent them,
    never `[DONE]` or an error object, everything that has arrived in one block (a block
    after which `done` is true is the last). A run of complete events that need no decision
    is taken without per-event work (see `SseDecoder.feed_plain`). Silence between reads
    longer than `read_timeout_s` (0 = unbounded) ends the stream with a 504. One clock read
    per chunk serves the watchdog and the gap count (`gaps`, shared by the client's
    streams).
    """

    def __init__(
        self,
        connection: Connection,
        engine: str,
        read_timeout_s: float,
        decoder: SseDecoder,
        *,
        first: list[SseEvent],
        drop_usage: bool,
        on_close: Callable[[], None],
        gaps: TokenGaps,
    ) -> None:
        self.engine = engine
        self.usage: dict[str, Any] | None = None
        # The usage chunk when it was not forwarded: it also carries the fingerprint.
        self.usage_chunk: dict[str, Any] | None = None
        self.done = False
        self._connection = connection
        self._decoder = decoder
        self._first: list[SseEvent] | None = first
        # The decoder may still hold events that arrived with the first token.
        self._buffered = True
        # A failure found after bytes that are still to be forwarded: raised next.
        self._failure: NarwhalError | None = None
        self._drop_usage = drop_usage
        self._on_close: Callable[[], None] | None = on_close
        self._gaps = gaps
        self._loop = asyncio.get_running_loop()
        self._last_read = self._loop.time()
        self._watchdog = (
            _Watchdog(clock(), read_timeout_s, connection.close) if read_timeout_s else None
        )
        # Set by `push_to`: plain events go out from the transport read that brings them.
        self._push: Callable[[bytes], bool] | None = None
        self._pushing = False
        self._push_failure: Exception | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self.done:
                await self._finish()
        finally:
            self.close()

    def close(self) -> None:
        """Release the connection to the pool after [DONE]; otherwise close it (aborts)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.done and self._connection.complete:
            self._connection.release()
        else:
            self._connection.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __aiter__(self) -> Self:
        return self

    def push_to(self, write: Callable[[bytes], bool]) -> None:
        """Iteration forwards runs of plain events itself, with `write`, as each read brings
        them (no task wakes per read); it yields only what needs its caller: events after a
        decision, the last block, and any block after `write` returned False (the client's
        writes paused: the caller's own write then waits for them). A failure `write` raises
        (the client gone) is raised by the iteration."""
        self._push = write

    async def __anext__(self) -> bytes:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        parts: list[bytes] = []
        if self._push is not None:
            self._pushing = True  # what the caller was given is written by now
        if self._first is not None:
            parts.append(_joined(self._first))
            self._first = None
        while not self.done:
            if self._buffered:
                self._buffered = False
                chunk = b""
            elif parts:
                break  # the rest needs a read: what has arrived goes out first
            else:
                if self._pushing:
                    await self._connection.pump(self._pushed)
                    if self._push_failure is not None:
                        gone, self._push_failure = self._push_failure, None
                        raise gone
                    if self._buffered:
                        continue
                chunk = await self._read()
                now = self._loop.time()
                self._gaps.add(now - self._last_read)
                self._last_read = now
                if self._watchdog is not None:
                    self._watchdog.last = now
            try:
                block = self._take(chunk)
            except NarwhalError as failure:
                if not parts:
                    raise
                # What arrived before the failure is forwarded first; it is raised next.
                self._failure = failure
                break
            if block:
                parts.append(block)
        if not parts:
            raise StopAsyncIteration
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def rest(self, one_pass: Callable[[bytes], T | None]) -> T | bytes:
        """The whole stream at once, for an answer assembled from it: read in bulk.

        The body past the first token is gathered without waking per read, until `[DONE]`
        or an error object shows, 1 MiB is held, or the body ends or fails. When what came
        is the usual stream (LF-framed events ending with `[DONE]`, no error object),
        `one_pass` gets the events before `[DONE]` undecided: it must parse every one of
        them and return None unless each is a JSON object it fully understands, with any
        event without choices last. What it returns is the answer. Otherwise the events are
        decided as iteration does them, batch by batch, and the forwarded bytes returned,
        the same failures raised (a failure found with what came is raised before the one
        that ended the read).
        """
        first = _joined(self._first) if self._first else b""
        self._first = None
        self._buffered = False
        held = self._decoder.held
        # What came with the first token may be the whole stream; a failure of the read
        # after [DONE] (the body ending, say) is no failure of the stream's.
        chunk, failure = (b"", None) if _DONE_MARK in held else await self._gather()
        events = b"".join((first, held, chunk))
        if events.endswith(_DONE_EVENT) and b"\r" not in events and b'"error"' not in events:
            answer = one_pass(events[: 2 - len(_DONE_EVENT)])
            if answer is not None:
                self.done = True
                return answer
        parts = [first]
        while True:
            parts.append(self._decide_all(chunk))
            if self.done:
                return b"".join(parts)
            if failure is not None:
                raise failure
            chunk, failure = await self._gather()

    async def _gather(self) -> tuple[bytes, NarwhalError | None]:
        """One bulk read, or the failure that ended the stream (raised once what came
        before it has been decided)."""
        try:
            chunk = await self._connection.read_bulk(_BULK_MARKS, HIGH_WATER, self._arrived)
        except HttpError as exc:
            return b"", self._broken(exc)
        return chunk, None if chunk else self._broken(None)

    def _arrived(self) -> None:
        """A transport read during a bulk read: the watchdog's and the gap count's clock."""
        now = self._loop.time()
        self._gaps.add(now - self._last_read)
        self._last_read = now
        if self._watchdog is not None:
            self._watchdog.last = now

    def _pushed(self, chunk: bytes) -> None:
        """One transport read while pumping: its plain events written at once; anything
        else (an event to decide, the end) ends the pump, left for the iteration."""
        now = self._loop.time()
        self._gaps.add(now - self._last_read)
        self._last_read = now
        if self._watchdog is not None:
            self._watchdog.last = now
        decoder = self._decoder
        plain = decoder.feed_plain(chunk)
        more = True
        if plain:
            assert self._push is not None
            try:
                more = self._push(plain)
            except Exception as exc:  # the client gone: raised by the iteration instead
                self._push_failure = exc
                more = False
        if decoder.ready():
            self._buffered = True
        if not more:
            self._pushing = False
        if self._buffered or not more:
            self._connection.unpump()

    def _decide_all(self, chunk: bytes) -> bytes:
        """The forwarded bytes of `chunk` and what the decoder holds, every event decided."""
        parts = [self._take(chunk)]
        while self._buffered and not self.done:
            self._buffered = False
            parts.append(self._take(b""))
        return b"".join(parts)

    def _take(self, chunk: bytes) -> bytes:
        """The bytes to forward out of `chunk` and what the decoder holds, without waiting.

        A run of plain events is taken whole; events that need a decision are decided.
        """
        decoder = self._decoder
        plain = decoder.feed_plain(chunk)
        if decoder.ready():
            self._buffered = True
        if plain or not self._buffered:
            return plain
        self._buffered = False
        try:
            events = self._decide(decoder.feed(b""))
        except SseError as exc:
            raise bad_stream(exc, self.engine) from None
        return _joined(events) if events else b""

    async def _finish(self) -> None:
        """After [DONE], read to the end of the answer so the connection can be reused.

        Done on leaving the stream's context, so that what came before [DONE] is not held
        back waiting for the engine to end its answer."""
        try:
            while await self._connection.read():
                pass
        except HttpError:
            pass

    async def _read(self) -> bytes:
        try:
            chunk = await self._connection.read()
        except HttpError as exc:
            raise self._broken(exc) from None
        if not chunk:
            raise self._broken(None)
        return chunk

    def _broken(self, exc: HttpError | None) -> NarwhalError:
        """The failure of a stream that broke (`exc`) or ended before [DONE]."""
        if self._watchdog is not None and self._watchdog.fired:
            return engine_error(
                Cause.SILENCE,
                f"engine went silent between tokens: engine {self.engine} sent nothing for "
                f"{self._watchdog.timeout:g} s",
                self.engine,
            )
        if exc is not None:
            return engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {self.engine} broke: {exc}",
                self.engine,
            )
        return engine_error(
            Cause.CLOSED_EARLY,
            f"decode stream from engine {self.engine} closed before [DONE]",
            self.engine,
        )

    def _decide(self, events: list[SseEvent]) -> list[SseEvent]:
        forward: list[SseEvent] = []
        for event in events:
            try:
                decision = classify_after_first_output(event.data)
            except SseError as exc:
                raise bad_stream(exc, self.engine) from None
            if decision is None:
                forward.append(event)
            elif decision.kind is EventKind.DONE:
                self.done = True
                break
            elif decision.kind is EventKind.ERROR:
                raise error_object(decision.payload or {}, self.engine)
            elif decision.kind is EventKind.USAGE:
                self.usage = _usage_of(decision.payload)
                if not self._drop_usage:
                    forward.append(event)
                else:
                    self.usage_chunk = decision.payload
            else:
                forward.append(event)
        return forward


def _joined(events: list[SseEvent]) -> bytes:
    return events[0].raw if len(events) == 1 else b"".join(event.raw for event in events)


async def stream_payloads(stream: DecodeStream) -> AsyncIterator[dict[str, Any]]:
    """The forwarded events of a stream as parsed chunks, for callers that need them all."""
    decoder = SseDecoder()
    async for data in stream:
        try:
            payloads = [classify(event.data).payload for event in decoder.feed(data)]
        except SseError as exc:
            # Relayed events only had their framing checked; here each must parse.
            raise bad_stream(exc, stream.engine) from None
        for payload in payloads:
            if payload is not None:
                yield payload


class _Watchdog:
    """Fires `on_silence` once no chunk has arrived for `timeout` seconds.

    The reader only stamps `last`; the timer re-arms itself lazily, so a busy stream
    costs no timer churn per chunk.
    """

    __slots__ = ("_clock", "_handle", "_on_silence", "fired", "last", "timeout")

    def __init__(self, clock: Clock, timeout: float, on_silence: Callable[[], None]) -> None:
        self._clock = clock
        self.timeout = timeout
        self.last = clock.loop.time()
        self.fired = False
        self._on_silence = on_silence
        self._handle = clock.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = self.last + self.timeout
        if self._clock.loop.time() >= due:
            self.fired = True
            self._on_silence()
        else:
            self._handle = self._clock.call_at(due, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


def _usage_of(payload: dict[str, Any] | None) -> dict[str, Any] | None:
    usage = (payload or {}).get("usage")
    return usage if isinstance(usage, dict) else None
