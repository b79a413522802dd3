"""The fast lane: the OpenAI routes that generate, in their usual form, straight off the socket.

aiohttp serves every route, but on the hot path its per-request machinery (request, URL and
response objects, routing, middlewares, a task per request besides its connection's) cost
16 to 17 % of the router's CPU per request on the benchmark's shapes. So the router's
listener reads client connections itself first. A request head is parsed by httptools;
the usual client request (POST to /v1/completions, /v1/chat/completions or /v1/responses,
HTTP/1.1, one Content-Length within the size limit, no content coding, no Expect or
Upgrade, its key accepted) is served here and its answer written to the transport
directly. Any other request hands the connection, from that request's first byte, to
aiohttp, which serves it and the rest of the connection as it always has (including the
400, 401 and 413 answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, cast

import httptools

from narwhal.config.secrets import bearer_allowed
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.reply import body_too_slow
from narwhal.runtime.clock import Pending, clock

if TYPE_CHECKING:
    from narwhal.http.served import Served

log = logging.getLogger("narwhal.front")

ROUTES = {
    b"/v1/completions": Endpoint.COMPLETIONS,
    b"/v1/chat/completions": Endpoint.CHAT,
    b"/v1/responses": Endpoint.RESPONSES,
}
# A head this long without its end is aiohttp's to refuse.
MAX_HEAD = 1 << 16
# Pipelined bytes held while a request is served, before reading pauses.
HIGH_WATER = 1 << 20
# Request headers that take a request off the fast lane.
_OFF_LANE = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})


class Front:
    """The listener's protocol factory: fast-lane connections, and aiohttp for the rest."""

    def __init__(
        self,
        router: Served,
        aiohttp: Callable[[], asyncio.Protocol],
        client_keys: tuple[bytes, ...],
    ) -> None:
        self.router = router
        self.aiohttp = aiohttp
        self.client_keys = client_keys
        self.max_bytes = router.config.serving.max_request_bytes
        self.client_timeout_s = router.config.server.client_timeout_s
        self.connections: set[FrontConnection] = set()
        self.dates = _Dates()

    def __call__(self) -> asyncio.Protocol:
        return FrontConnection(self)

    def close(self) -> None:
        """End every connection still on the fast lane (the router has drained by now)."""
        for connection in list(self.connections):
            connection.close()


class _Head:
    """httptools' callbacks for one request head."""

    __slots__ = ("complete", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True

    def on_body(self, body: bytes) -> None:
        # Only the head is fed: body bytes mean the parser saw its end elsewhere.
        self.complete = False


class FrontConnection(asyncio.Protocol):
    """One client connection while it is on the fast lane: one request at a time, in order."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # Bytes of requests not yet started (the head at hand, and any pipelined after it).
        self._buffer = b""
        self._reply: FrontReply | None = None
        self._task: asyncio.Task[None] | None = None
        self._clock = clock()
        self._timer: Pending | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drained: asyncio.Future[None] | None = None
        self.lost = False

    # asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)
        self._idle()

    def data_received(self, data: bytes) -> None:
        reply = self._reply
        if reply is not None and not reply.body_complete:
            data = reply.feed(data)
            if not data:
                return
        self._buffer = self._buffer + data if self._buffer else data
        if self._task is None:
            self._next()
        elif len(self._buffer) > HIGH_WATER and not self._reading_paused:
            assert self.transport is not None
            self._reading_paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        self._stop_timer()
        if self._reply is not None:
            self._reply.gone()
        if self._task is not None:
            # The client left: the request path records it (499) and lets go of everything.
            self._task.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_writer()

    # Requests ------------------------------------------------------------------------

    def _next(self) -> None:
        """Start the request whose head is at the front of the buffer, if it is all in."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                self._hand_over()
            return
        head_bytes = buffer[: end + 4]
        lines = head_bytes.count(b"\r\n")
        if head_bytes.count(b"\n") != lines or head_bytes.count(b"\r") != lines:
            # Bare CR or LF: where the head ends is then aiohttp's parser's to say.
            self._hand_over()
            return
        head = _Head()
        parser = httptools.HttpRequestParser(head)
        try:
            parser.feed_data(head_bytes)
        except httptools.HttpParserError:
            self._hand_over()
            return
        endpoint, length = self._fast_lane(head, parser)
        if endpoint is None or not head.complete:
            self._hand_over()
            return
        self._stop_timer()
        reply = FrontReply(self, head.headers, length, parser.should_keep_alive())
        self._buffer = reply.feed(buffer[end + 4 :])
        self._reply = reply
        self._task = self._loop.create_task(self._serve(reply, endpoint))

    def _fast_lane(
        self, head: _Head, parser: httptools.HttpRequestParser
    ) -> tuple[Endpoint | None, int]:
        """The route of a request the fast lane serves, and its body's length."""
        if parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
            return None, 0
        endpoint = ROUTES.get(head.url)
        if endpoint is None:
            return None, 0
        length = -1
        authorization: str | None = None
        for name, value in head.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                if length >= 0 or not value.isdigit():
                    return None, 0
                length = int(value)
            elif lowered == b"authorization":
                authorization = value.decode("latin-1")
            elif lowered in _OFF_LANE:
                return None, 0
        if not 0 <= length <= self.front.max_bytes:
            return None, 0
        keys = self.front.client_keys
        if keys and not bearer_allowed(authorization, keys):
            return None, 0
        return endpoint, length

    async def _serve(self, reply: FrontReply, endpoint: Endpoint) -> None:
        try:
            await self.front.router.handle(reply, endpoint)
        except Exception:
            # A fault of the router's own: answer 500 if nothing was sent, and close.
            log.exception("request %s failed inside the router", endpoint.value)
            if not reply.started and not self.lost:
                error = NarwhalError(500, "internal router error", Cause.UNAVAILABLE)
                with contextlib.suppress(ConnectionResetError):
                    await reply.answer(500, error.json(), {}, close=True)
            self.close()
            return
        finally:
            self._task = None
            self._reply = None
        if self.lost:
            return
        if not reply.finished or reply.close_after:
            self.close()
            return
        if self._reading_paused:
            assert self.transport is not None
            self._reading_paused = False
            self.transport.resume_reading()
        self._idle()
        if self._buffer:
            self._next()

    def _hand_over(self) -> None:
        """aiohttp takes the connection, from the first byte of the request at hand."""
        transport = self.transport
        assert transport is not None
        self._stop_timer()
        self.front.connections.discard(self)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        handler = self.front.aiohttp()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self._buffer = self._buffer, b""
        if data:
            handler.data_received(data)

    # Timers and writing ----------------------------------------------------------------

    def _idle(self) -> None:
        """From the connection's opening, or its last answer, until a request's head is
        complete: an idle or slow-header client is disconnected after the client timeout."""
        self._stop_timer()
        self._timer = self._clock.call_at(
            self._loop.time() + self.front.client_timeout_s, self.close
        )

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()

    def send(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        while self._writing_paused and not self.lost:
            self._drained = self._loop.create_future()
            await self._drained
        if self.lost:
            raise ConnectionResetError("the client closed the connection")

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    @property
    def writing_paused(self) -> bool:
        return self._writing_paused


class FrontReply:
    """A fast-lane request: its headers and body, and its answer written by hand."""

    def __init__(
        self,
        connection: FrontConnection,
        headers: list[tuple[bytes, bytes]],
        length: int,
        keep_alive: bool,
    ) -> None:
        self.connection = connection
        self._headers: dict[str, str] = {}
        for name, value in headers:
            self._headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self._length = length
        self._parts: list[bytes] = []
        self._received = 0
        self._arrived: asyncio.Future[None] | None = None
        self._head = b""
        self._committed = False
        # Whether any byte of the answer went out, whether all of it did, and whether the
        # connection ends with it.
        self.started = False
        self.finished = False
        self.close_after = not keep_alive

    # The request -----------------------------------------------------------------------

    @property
    def body_complete(self) -> bool:
        return self._received >= self._length

    def feed(self, data: bytes) -> bytes:
        """Take the body's bytes from `data`; returns what follows the body."""
        wanted = self._length - self._received
        if wanted <= 0:
            return data
        piece = data[:wanted]
        if piece:
            self._parts.append(piece)
            self._received += len(piece)
            if self.body_complete and self._arrived is not None and not self._arrived.done():
                self._arrived.set_result(None)
        return data[wanted:]

    def gone(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_exception(ConnectionResetError("the client closed the connection"))

    def header(self, name: str) -> str | None:
        return self._headers.get(name.lower())

    async def body(self, timeout_s: float) -> bytes:
        if not self.body_complete:
            self._arrived = asyncio.get_running_loop().create_future()
            try:
                async with clock().timeout(timeout_s):
                    await self._arrived
            except TimeoutError:
                raise body_too_slow(timeout_s) from None
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # The answer ------------------------------------------------------------------------

    @property
    def committed(self) -> bool:
        return self._committed

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        ending = b"Connection: close\r\n\r\n" if self.close_after else b"\r\n"
        self._head = self._status_head(200, headers) + b"Transfer-Encoding: chunked\r\n" + ending
        self._committed = True

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self._send(b"%x\r\n%b\r\n" % (len(data), data))
        if self.connection.writing_paused:
            await self.connection.drain()

    def writer(self) -> Callable[[bytes], bool]:
        return self._write_now

    def _write_now(self, data: bytes) -> bool:
        self._send(b"%x\r\n%b\r\n" % (len(data), data))
        return not self.connection.writing_paused

    async def end(self, data: bytes = b"") -> None:
        last = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        self._send(last)
        self.finished = True

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        self.close_after = self.close_after or close
        head = self._status_head(status, headers)
        length = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        ending = b"Connection: close\r\n\r\n" if self.close_after else b"\r\n"
        self._send(head + length + ending + body)
        self.finished = True

    def _status_head(self, status: int, headers: Mapping[str, str]) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        lines += [f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items()]
        lines.append(b"Date: " + self.connection.front.dates.now() + b"\r\n")
        return b"".join(lines)

    def _send(self, data: bytes) -> None:
        if self._head:
            data, self._head = self._head + data, b""
        self.started = True
        self.connection.send(data)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


class _Dates:
    """The Date header's value, formatted once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second, self._value = second, formatdate(second, usegmt=True).encode()
        return self._value
