"""The fast lane's protocol against a recording transport: which requests it keeps, what it
hands to aiohttp (byte for byte), how it reads bodies split anywhere, and how it waits
for a slow reader."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from narwhal.app.process import Router
from narwhal.http.front import Front, FrontConnection, FrontReply
from narwhal.protocol.bodies import Endpoint


class Transport:
    """What the protocol writes, and whether it closed, paused or moved on."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False
        self.protocol: asyncio.BaseProtocol | None = None
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Aiohttp(asyncio.Protocol):
    """Stands in for aiohttp's protocol: keeps what it is given."""

    def __init__(self) -> None:
        self.received = b""
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += data


class Handler:
    """The router's `handle`: records each request and answers with its body echoed."""

    def __init__(self) -> None:
        self.seen: list[tuple[Endpoint, bytes, str | None]] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, reply: FrontReply, endpoint: Endpoint) -> None:
        body = await reply.body(1.0)
        self.seen.append((endpoint, body, reply.header("x-request-id")))
        if self.hold is not None:
            await self.hold.wait()
        await reply.answer(200, body, {"X-Seen": str(len(self.seen))})


def _front(keys: tuple[bytes, ...] = ()) -> tuple[Front, Handler, list[Aiohttp]]:
    handler = Handler()
    config = SimpleNamespace(
        serving=SimpleNamespace(max_request_bytes=1000), server=SimpleNamespace(client_timeout_s=5)
    )
    router = cast(Router, SimpleNamespace(config=config, handle=handler))
    handed: list[Aiohttp] = []

    def aiohttp() -> asyncio.Protocol:
        handed.append(Aiohttp())
        return handed[-1]

    return Front(router, aiohttp, keys), handler, handed


def _post(route: bytes, body: bytes, *extra: bytes) -> bytes:
    head = b"POST %b HTTP/1.1\r\nHost: r\r\n" % route + b"".join(e + b"\r\n" for e in extra)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _connect(front: Front) -> tuple[FrontConnection, Transport]:
    connection = cast(FrontConnection, front())
    transport = Transport()
    connection.connection_made(cast(asyncio.Transport, transport))
    return connection, transport


async def test_requests_split_anywhere_are_read_whole_and_answered_in_order() -> None:
    front, handler, handed = _front()
    connection, transport = _connect(front)
    stream = _post(b"/v1/completions", b'{"a": 1}', b"X-Request-Id: one") + _post(
        b"/v1/chat/completions", b'{"b": 22}'
    )
    for start in range(0, len(stream), 7):
        connection.data_received(stream[start : start + 7])
        await _settle()
    await _settle()
    assert handler.seen == [
        (Endpoint.COMPLETIONS, b'{"a": 1}', "one"),
        (Endpoint.CHAT, b'{"b": 22}', None),
    ]
    answers = transport.written.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [a.split(b"\r\n\r\n", 1)[1] for a in answers] == [b'{"a": 1}', b'{"b": 22}']
    assert b"X-Seen: 1\r\n" in answers[0] and b"X-Seen: 2\r\n" in answers[1]
    assert all(b"Content-Length: " in a and b"Date: " in a for a in answers)
    assert not handed and not transport.closed


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n",
        _post(b"/v1/models", b"{}"),
        _post(b"/v1/completions?x=1", b"{}"),
        _post(b"/v1/completions", b"{}").replace(b"HTTP/1.1", b"HTTP/1.0"),
        _post(b"/v1/completions", b"{}", b"Content-Encoding: gzip"),
        _post(b"/v1/completions", b"{}", b"Expect: 100-continue"),
        _post(b"/v1/completions", b"{}", b"Content-Length: 2"),
        _post(b"/v1/completions", b"x" * 1001),
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        _post(b"/v1/completions", b"{}").replace(b"\r\nHost", b"\nHost"),
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=[
        "other route",
        "other POST",
        "query",
        "HTTP/1.0",
        "gzip",
        "expect",
        "two lengths",
        "too large",
        "chunked",
        "bare LF",
        "garbage",
    ],
)
async def test_other_requests_hand_aiohttp_every_byte(request_bytes: bytes) -> None:
    front, handler, handed = _front()
    connection, transport = _connect(front)
    connection.data_received(request_bytes + b"and what follows")
    await _settle()
    assert not handler.seen
    (taken,) = handed
    assert taken.received == request_bytes + b"and what follows"
    assert transport.protocol is taken and transport.written == b""
    assert connection not in front.connections


async def test_a_key_the_fast_lane_refuses_is_aiohttps_to_answer() -> None:
    front, handler, handed = _front(keys=(b"sk-1",))
    connection, _ = _connect(front)
    connection.data_received(_post(b"/v1/completions", b"{}", b"Authorization: Bearer sk-2"))
    await _settle()
    assert len(handed) == 1 and not handler.seen
    allowed, _ = _connect(front)
    allowed.data_received(_post(b"/v1/completions", b"{}", b"Authorization: Bearer sk-1"))
    await _settle()
    assert len(handed) == 1 and len(handler.seen) == 1


async def test_a_later_request_of_another_kind_hands_over_at_its_own_first_byte() -> None:
    front, handler, handed = _front()
    connection, transport = _connect(front)
    health = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
    connection.data_received(_post(b"/v1/completions", b"{}") + health)
    await _settle()
    assert len(handler.seen) == 1 and transport.written.startswith(b"HTTP/1.1 200 OK")
    (taken,) = handed
    assert taken.received == health


async def test_a_stream_waits_for_a_slow_reader_and_stops_when_it_leaves() -> None:
    front, _, _ = _front()
    connection, transport = _connect(front)
    reply = FrontReply(connection, [], 0, keep_alive=True)
    await reply.open_stream({"Content-Type": "text/event-stream"})
    connection.pause_writing()
    writing = asyncio.ensure_future(reply.write(b"data: 1\n\n"))
    await _settle()
    assert not writing.done()
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream")
    assert transport.written.endswith(b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
    connection.resume_writing()
    await writing
    await reply.end(b"last")
    assert transport.written.endswith(b"4\r\nlast\r\n0\r\n\r\n")
    connection.pause_writing()
    writing = asyncio.ensure_future(reply.write(b"more"))
    await _settle()
    connection.connection_lost(None)
    with pytest.raises(ConnectionResetError):
        await writing
    with pytest.raises(ConnectionResetError):
        await reply.write(b"after")


async def test_a_client_that_leaves_mid_body_cancels_its_request() -> None:
    front, handler, _ = _front()
    connection, _ = _connect(front)
    connection.data_received(_post(b"/v1/completions", b'{"a": 1}')[:-3])
    await _settle()
    task = connection._task
    assert task is not None and not task.done()
    connection.connection_lost(None)
    await _settle()
    assert task.cancelled() and not handler.seen


async def test_connection_close_from_the_client_ends_the_connection() -> None:
    front, handler, _ = _front()
    connection, transport = _connect(front)
    connection.data_received(_post(b"/v1/completions", b"{}", b"Connection: close"))
    await _settle()
    assert handler.seen and transport.closed
    assert b"Connection: close\r\n" in transport.written
