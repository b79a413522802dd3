"""A Responses decode leg (`/v1/responses`): its events watched, relayed, and its failures
raised with the same causes as the other routes' streams.

`ResponsesStream.first_output` reads up to the first output delta, holding the events
before it (`response.created`, `response.in_progress`, the `…added` events) for the client;
from there iteration yields each read's events as bytes, until `response.completed` or
`response.incomplete`. An `error` or `response.failed` event, a stream that closes first,
silence past the read timeout, or an event that is not a Responses event raise a
`NarwhalError`. The events are decided one by one (`protocol.responses`): this route has
none of the chat routes' bulk paths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Self

import orjson

from narwhal.engines.gaps import TokenGaps
from narwhal.engines.http import Connection, HttpError
from narwhal.engines.leg_errors import bad_stream
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.protocol.responses import EventError, Kind, failure_of, read_event
from narwhal.protocol.sse import SseDecoder, SseError, SseEvent
from narwhal.runtime.clock import clock

# Events held before the first output delta; an engine that sends more is broken.
MAX_HELD_BYTES = 1 << 20


class ResponsesStream:
    """An open Responses decode leg past its first output delta."""

    def __init__(
        self,
        connection: Connection,
        engine: str,
        read_timeout_s: float,
        *,
        rewrite: Mapping[str, Any],
        on_close: Callable[[], None],
        gaps: TokenGaps,
    ) -> None:
        """`rewrite`: members set in the `response` object that lifecycle events carry
        (the conversation's `previous_response_id` and `store`, which the engine did not
        see)."""
        self.engine = engine
        self.done = False
        # The last event's sequence number (-1 before any): the router's own terminal
        # event, should it end the stream, takes the next.
        self.sequence_number = -1
        # The response object of the event that ended the stream, rewritten.
        self.response: dict[str, Any] | None = None
        self._connection = connection
        self._decoder = SseDecoder()
        self._rewrite = rewrite
        self._held: list[bytes] = []
        self._on_close: Callable[[], None] | None = on_close
        self._gaps = gaps
        self._read_timeout_s = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last_read = self._loop.time()
        self._output = False
        # A failure found after events still to be relayed: raised by the next read.
        self._failure: NarwhalError | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self.done:
                await self._finish()
        finally:
            self.close()

    def close(self) -> None:
        """Release the connection to the pool after the stream ended well; otherwise close
        it (which aborts the request in the engine)."""
        if self.done and self._connection.complete:
            self._connection.release()
        else:
            self._connection.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # Up to the first output -------------------------------------------------------------

    async def first_output(self) -> None:
        """Read until the first output delta; the caller bounds the wait (the first-token
        timeout). Raises the engine's fault when the stream fails or ends before any."""
        held_bytes = 0
        while not self._output:
            chunk = await self._connection.read()
            if not chunk:
                raise engine_error(
                    Cause.CLOSED_EARLY,
                    f"decode stream from engine {self.engine} closed before any token",
                    self.engine,
                )
            for block in self._decided(chunk):
                self._held.append(block)
                held_bytes += len(block)
            if self._failure is not None and not self._output:
                # Failed before any output: nothing held is the client's to see.
                raise self._failure
            if held_bytes > MAX_HELD_BYTES:
                raise engine_error(
                    Cause.BAD_RESPONSE,
                    f"engine {self.engine} sent more than {MAX_HELD_BYTES} bytes of events "
                    "before its first token",
                    self.engine,
                )
            if self.done and not self._output:
                raise engine_error(
                    Cause.DONE_BEFORE_TOKEN,
                    "stream ended with response.completed before any output arrived",
                    self.engine,
                )
        self._last_read = self._loop.time()

    # Past it ------------------------------------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        """What has arrived, as bytes to forward; the held events come first."""
        if self._held:
            held, self._held = self._held, []
            return b"".join(held)
        if self._failure is not None:
            raise self._failure
        while not self.done:
            chunk = await self._read()
            blocks = self._decided(chunk)
            if blocks:
                return b"".join(blocks)
        raise StopAsyncIteration

    async def rest(self) -> dict[str, Any]:
        """Read the stream to its end; the response object it ended with."""
        self._held = []
        while not self.done:
            if self._failure is not None:
                raise self._failure
            self._decided(await self._read())
        assert self.response is not None
        return self.response

    async def _read(self) -> bytes:
        timeout_s = self._read_timeout_s
        try:
            if timeout_s:
                async with clock().timeout(timeout_s):
                    chunk = await self._connection.read()
            else:
                chunk = await self._connection.read()
        except TimeoutError:
            self._connection.close()
            raise engine_error(
                Cause.SILENCE,
                f"engine went silent between tokens: engine {self.engine} sent nothing for "
                f"{timeout_s:g} s",
                self.engine,
            ) from None
        except HttpError as exc:
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {self.engine} broke: {exc}",
                self.engine,
            ) from None
        if not chunk:
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {self.engine} closed before response.completed",
                self.engine,
            )
        now = self._loop.time()
        self._gaps.add(now - self._last_read)
        self._last_read = now
        return chunk

    def _decided(self, chunk: bytes) -> list[bytes]:
        """The bytes to forward of each complete event in `chunk`, every event decided;
        raises the failure an event reports."""
        try:
            events = self._decoder.feed(chunk)
        except SseError as exc:
            raise bad_stream(exc, self.engine) from None
        blocks: list[bytes] = []
        for event in events:
            if self.done:
                break  # nothing after the end is relayed
            try:
                kind, number = read_event(event.data)
            except EventError as exc:
                failure = bad_stream(SseError(str(exc)), self.engine)
                if not blocks:
                    raise failure from None
                self._failure = failure
                break
            if kind is Kind.FAILED or kind is Kind.ERROR:
                # What came before the failure is relayed first; it is raised next.
                if not blocks:
                    raise self._failure_of(event.data)
                self._failure = self._failure_of(event.data)
                break
            if number is not None:
                self.sequence_number = number
            if kind is Kind.OUTPUT:
                self._output = True
                blocks.append(event.raw)
            elif kind is Kind.OTHER:
                blocks.append(self._rewritten(event))
            elif kind is Kind.ENDED:
                self.done = True
                blocks.append(self._rewritten(event, ended=True))
                if self.response is None:
                    raise bad_stream(
                        SseError("the stream's last event carries no response object"),
                        self.engine,
                    )
        return blocks

    def _rewritten(self, event: SseEvent, *, ended: bool = False) -> bytes:
        """The event, with the router's members set in the response object it carries."""
        if b'"response"' not in event.data:
            return event.raw
        payload = orjson.loads(event.data)
        response = payload.get("response")
        if not isinstance(response, dict):
            return event.raw
        response.update(self._rewrite)
        response.pop("kv_transfer_params", None)
        if ended:
            self.response = response
        name = payload.get("type")
        head = f"event: {name}\n".encode() if isinstance(name, str) else b""
        return head + b"data: " + orjson.dumps(payload) + b"\n\n"

    def _failure_of(self, data: bytes) -> NarwhalError:
        payload = orjson.loads(data)
        status, message, param = failure_of(payload)
        error = engine_error(
            Cause.ERROR_OBJECT,
            f"engine {self.engine} reported an error: {message}",
            self.engine,
            status=status,
            detail={
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "param": param,
                "code": status,
            },
        )
        # After output, the router's terminal event names the member at fault too.
        error.param = error.param or param
        return error

    async def _finish(self) -> None:
        """After the end, read to the end of the answer so the connection can be reused."""
        try:
            while await self._connection.read():
                pass
        except HttpError:
            pass
