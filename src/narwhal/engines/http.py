"""A lean HTTP/1.1 client for the two legs: pooled keep-alive connections, bytes in and out.

The legs are always the same shape (a JSON POST; a JSON answer or a chunked event stream),
so a general-purpose client's per-request machinery is cost without benefit on the hot
path. Requests are written with one transport write; responses are parsed by httptools
(C); the body arrives as de-chunked bytes, coalesced per read. Closing a connection aborts
the request inside vLLM, which is how a leg is cancelled.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import islice
from typing import cast
from urllib.parse import urlsplit

import httptools

from narwhal.runtime.clock import clock

# vLLM closes idle keep-alive connections after 5 s; stop reusing ours a little before.
KEEPALIVE_S = 4.0
# Body bytes held unread before the socket stops being read (back-pressure to the engine).
HIGH_WATER = 1 << 20

Fetch = Callable[[str, float], Awaitable[bytes | None]]
"""A GET of a URL within a timeout (`EngineClient.fetch`): its body, or None when it did not
answer 200 in time."""


class HttpError(Exception):
    """A transport failure; `connected` says whether the request could have reached the engine."""

    connected = True


class ConnectFailed(HttpError):
    """No connection could be made (refused, unreachable, TLS, connect timeout)."""

    connected = False


class ConnectionBroken(HttpError):
    """The connection closed, reset, or answered something that is not HTTP."""


class TooLarge(HttpError):
    """An answer longer than the caller allows."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        host = parts.hostname or "localhost"
        port = parts.port or (443 if scheme == "https" else 80)
        return cls(scheme, host, port, parts.netloc.encode())


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: ConnectionPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.reason = ""
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future[int] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._keep_alive = False
        self._received = False
        self._error: HttpError | None = None
        self._lost = False
        # While `read_bulk` waits: what wakes it, and whom each transport read is told.
        self._markers: tuple[bytes, ...] = ()
        self._span = 0  # the longest marker's length: how much of the last piece to keep
        self._bulk_limit = 0
        self._tail = b""
        self._marked = False
        self._on_data: Callable[[], None] | None = None
        # While `pump` runs: who takes each body piece as it arrives.
        self._sink: Callable[[bytes], None] | None = None

    # The request ---------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.status = 0
        self._head = self._loop.create_future()
        self._body.clear()
        self._buffered = 0
        self._complete = False
        self._received = False
        self._error = None
        self.transport.write(data)

    async def head(self) -> int:
        """The response status, once the headers are in."""
        assert self._head is not None
        return await self._head

    async def read(self) -> bytes:
        """The body bytes received so far (waiting for some); b"" once the body is complete."""
        while not self._body:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_bulk(
        self, markers: tuple[bytes, ...], limit: int, on_data: Callable[[], None]
    ) -> bytes:
        """As `read`, but waiting until the bytes held contain one of `markers` (a hint: the
        caller checks what it gets), reach `limit`, or the body ends or fails, so that a
        body arriving in many small reads wakes the caller once. `on_data` is told of each
        transport read meanwhile (the caller's clock for silences)."""
        held = b"".join(self._body)
        self._marked = any(marker in held for marker in markers)
        self._markers, self._bulk_limit, self._on_data = markers, limit, on_data
        self._span = max(map(len, markers))
        self._tail = held[-self._span :]
        try:
            while not (
                self._marked or self._complete or self._error is not None or self._buffered >= limit
            ):
                await self._wait()
        finally:
            self._markers, self._tail, self._on_data = (), b"", None
        return await self.read()

    async def pump(self, sink: Callable[[bytes], None]) -> None:
        """Hand each body piece to `sink` in the transport read that brings it, until `unpump`
        is called (by the sink, say) or the body ends or fails: a stream relayed piece by
        piece wakes no task per piece. Only when nothing is held: what arrives is the sink's.
        """
        if self._body or self._complete or self._error is not None:
            return
        self._sink = sink
        try:
            while self._sink is not None and not self._complete and self._error is None:
                await self._wait()
        finally:
            self._sink = None

    async def _wait(self) -> None:
        """Until the next piece, the body's end or a failure (whatever `_wake`s)."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def unpump(self) -> None:
        """End `pump`: later pieces are held for `read` again."""
        self._sink = None
        self._wake()

    async def read_all(self, limit: int) -> bytes:
        """The whole body; raises `TooLarge` past `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        while data := await self.read():
            size += len(data)
            if size > limit:
                raise TooLarge(f"answer larger than {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        return self._complete

    def release(self) -> None:
        """Back to the pool if the exchange ended cleanly and may continue; else close."""
        if self._complete and not self._lost and self._keep_alive:
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection; an engine aborts the request it was serving."""
        if self.transport is not None and not self._lost:
            self.transport.abort()
        self._lost = True

    # asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._received = True
        if self._on_data is not None:
            self._on_data()
        held = len(self._body)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionBroken(f"malformed HTTP response: {exc}"))
            self.close()
        if self._markers and len(self._body) > held:
            self._bulk_arrived(held)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._complete:
            reason = f": {exc}" if exc else ""
            self._fail(ConnectionBroken(f"connection closed before the answer ended{reason}"))

    # httptools callbacks --------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Read here: the parser resets once the message completes.
        self._keep_alive = self.parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(self.status)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink(body)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if not self._markers:
            self._wake()
        # Bulk reading: the pieces of one transport read are judged together, once it is
        # fed (`_bulk_arrived`), rather than piece by piece.

    def _bulk_arrived(self, held: int) -> None:
        """Bulk reading: wake only for a marker (also one split between pieces or reads)
        or the limit; the end of the body and failures wake as usual. `held` is how many
        pieces were held before this read's."""
        body = self._body
        new = body[-1] if len(body) == held + 1 else b"".join(islice(body, held, None))
        span = self._span
        edge = self._tail + new[:span]
        for marker in self._markers:
            if marker in new or marker in edge:
                self._marked = True
                break
        else:
            if self._buffered < self._bulk_limit:
                self._tail = new[-span:] if len(new) >= span else edge[-span:]
                return
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HttpError) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()

    @property
    def answered(self) -> bool:
        """Whether any byte of the current response has arrived."""
        return self._received


class ConnectionPool:
    """Idle keep-alive connections by origin, most recently used first."""

    def __init__(self, *, connect_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self._idle: dict[Origin, list[Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._closed = False

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.of(url)
        return origin

    async def send(
        self, origin: Origin, data: bytes, on_sent: Callable[[], None] | None = None
    ) -> Connection:
        """Send one request on a pooled or new connection and wait for the response head.

        A reused connection that the engine had already closed fails before any byte of
        answer; that request never reached it, so it is sent once more on a new one.
        `on_sent` is told once the request's bytes are handed to a connection.
        """
        connection = self._take(origin)
        if connection is not None:
            connection.send(data)
            if on_sent is not None:
                on_sent()
            try:
                await connection.head()
                return connection
            except ConnectionBroken:
                connection.close()
                if connection.answered:
                    raise
            except BaseException:
                # Cancelled (a deadline, a client gone) while the engine answers: the
                # connection is neither idle nor anyone's, so it goes.
                connection.close()
                raise
        connection = await self._connect(origin)
        connection.send(data)
        if on_sent is not None:
            on_sent()
        try:
            await connection.head()
        except BaseException:
            connection.close()
            raise
        return connection

    def _take(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < KEEPALIVE_S and not connection._lost:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.scheme == "https":
            tls = self.tls or ssl.create_default_context()
        try:
            async with clock().timeout(self.connect_timeout_s):
                transport, protocol = await loop.create_connection(
                    lambda: Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"no connection within {self.connect_timeout_s:g} s (engine.connect_timeout_s)"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        assert isinstance(protocol, Connection)
        protocol.transport = transport
        return protocol

    def put(self, connection: Connection) -> None:
        if self._closed:
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(connection.origin, []).append(connection)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def request_bytes(
    path: str, origin: Origin, headers: bytes, request_id: str, body: bytes, extra: bytes = b""
) -> bytes:
    """A complete POST, ready for one write. `headers` (the client's own) and `extra` (this
    request's, such as its trace context) are pre-encoded `Name: value\\r\\n` lines."""
    return b"".join(
        (
            b"POST ",
            path.encode(),
            b" HTTP/1.1\r\nHost: ",
            origin.host_header,
            b"\r\nContent-Length: ",
            str(len(body)).encode(),
            b"\r\nX-Request-Id: ",
            request_id.encode(),
            b"\r\n",
            headers,
            extra,
            b"\r\n",
            body,
        )
    )


def get_bytes(path: str, origin: Origin) -> bytes:
    """A complete GET of `path` (off the request path: an engine's `/metrics`, its models)."""
    return b"".join(
        (b"GET ", path.encode(), b" HTTP/1.1\r\nHost: ", origin.host_header, b"\r\n\r\n")
    )
