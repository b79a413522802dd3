"""A stream pushed to its client: plain events go out in the transport read that brings them,
with nothing yielded; whatever needs a decision, a paused client, a client gone, a broken or
silent engine come back to the iteration, and no byte is lost, doubled or reordered."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.gaps import TokenGaps
from narwhal.engines.http import Connection, Origin
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.protocol.sse import SseDecoder, SseEvent

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = b"data: [DONE]\n\n"
USAGE = b'data: {"choices":[],"usage":{"completion_tokens":4}}\n\n'


def token(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % text.encode()


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Transport:
    """Enough of a transport for a connection fed by hand; an abort loses the connection."""

    def __init__(self) -> None:
        self.connection: Connection | None = None
        self.aborted = False

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True
        if self.connection is not None:
            self.connection.connection_lost(None)


class Client:
    """The client's side of a push: what it was written, paused or gone on demand."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self.gone = False

    def write(self, data: bytes) -> bool:
        if self.gone:
            raise ConnectionResetError("the client closed the connection")
        self.written.append(data)
        return not self.paused


async def open_stream(read_timeout_s: float = 0.0) -> tuple[Connection, Transport, DecodeStream]:
    transport = Transport()
    conn = Connection(cast(Any, None), Origin.of("http://127.0.0.1:1"))
    transport.connection = conn
    conn.connection_made(cast(Any, transport))
    conn.send(b"POST /v1/completions HTTP/1.1\r\n\r\n")
    conn.data_received(HEAD)
    assert await conn.head() == 200
    first = [SseEvent(token("first"), token("first")[len(b"data: ") : -2])]
    stream = DecodeStream(
        conn,
        "d0",
        read_timeout_s,
        SseDecoder(),
        first=first,
        drop_usage=True,
        on_close=lambda: None,
        gaps=TokenGaps(),
    )
    return conn, transport, stream


async def next_block(stream: DecodeStream) -> bytes | None:
    """The next block the iteration yields; None once it ends."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def within(pending: asyncio.Future[Any]) -> Any:
    """A regression must fail the test, not hang it."""
    return await asyncio.wait_for(pending, 10)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def pushing(
    read_timeout_s: float = 0.0,
) -> tuple[Connection, Transport, DecodeStream, Client, asyncio.Future[bytes | None]]:
    """A stream pushing to a client, its first token taken, its next block awaited."""
    conn, transport, stream = await open_stream(read_timeout_s)
    client = Client()
    stream.push_to(client.write)
    assert await anext(stream) == token("first")  # the first token is the caller's
    pending = asyncio.ensure_future(next_block(stream))
    await settle()
    return conn, transport, stream, client, pending


async def test_plain_tokens_are_written_in_the_read_that_brings_them() -> None:
    conn, _, stream, client, pending = await pushing()
    for text in ("a", "b", "c"):
        conn.data_received(piece(token(text)))
        # Written before any task ran: the read itself wrote it.
        assert client.written[-1] == token(text)
    assert not pending.done()
    conn.data_received(piece(USAGE + DONE) + b"0\r\n\r\n")
    assert await within(pending) is None
    assert stream.done and stream.usage == {"completion_tokens": 4}
    assert client.written == [token(t) for t in "abc"]


async def test_a_paused_client_gets_the_next_block_from_its_own_write() -> None:
    conn, _, stream, client, pending = await pushing()
    client.paused = True
    conn.data_received(piece(token("a")))
    assert client.written == [token("a")]
    await settle()
    assert not pending.done()
    # Paused: what comes next is the iteration's to yield, so the caller's write can wait,
    # also when it comes in two reads.
    half = len(token("b")) // 2
    conn.data_received(piece(token("b")[:half]))
    await settle()
    conn.data_received(piece(token("b")[half:]))
    assert await within(pending) == token("b")
    assert client.written == [token("a")]
    client.paused = False
    pending = asyncio.ensure_future(next_block(stream))
    await settle()
    conn.data_received(piece(token("c")))
    assert client.written == [token("a"), token("c")]
    conn.data_received(piece(DONE) + b"0\r\n\r\n")
    assert await within(pending) is None


async def test_a_client_gone_mid_push_ends_the_iteration_with_its_error() -> None:
    conn, _, stream, client, pending = await pushing()
    client.gone = True
    conn.data_received(piece(token("a")))
    with pytest.raises(ConnectionResetError):
        await within(pending)
    stream.close()
    assert conn.complete is False


async def test_an_error_object_after_pushed_tokens_is_raised_after_them() -> None:
    conn, _, _stream, client, pending = await pushing()
    conn.data_received(piece(token("a")))
    conn.data_received(piece(token("b") + b'data: {"error":{"message":"boom","code":503}}\n\n'))
    with pytest.raises(NarwhalError) as failure:
        await within(pending)
    assert failure.value.cause is Cause.ERROR_OBJECT and "boom" in failure.value.message
    assert client.written == [token("a"), token("b")]


async def test_an_engine_that_breaks_mid_push_is_closed_early() -> None:
    conn, _, _stream, client, pending = await pushing()
    conn.data_received(piece(token("a")))
    conn.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(NarwhalError) as failure:
        await within(pending)
    assert failure.value.cause is Cause.CLOSED_EARLY
    assert client.written == [token("a")]


async def test_an_engine_silent_mid_push_is_a_silence_504() -> None:
    conn, transport, _stream, client, pending = await pushing(read_timeout_s=0.05)
    conn.data_received(piece(token("a")))
    with pytest.raises(NarwhalError) as failure:
        await asyncio.wait_for(pending, 10)
    assert failure.value.cause is Cause.SILENCE and failure.value.status == 504
    assert transport.aborted and client.written == [token("a")]


EVENTS = st.lists(
    st.one_of(
        st.text("abc xyz", max_size=5).map(token),
        st.just(USAGE),
        st.just(b'data: {"choices":[{"index":0,"text":"crlf"}]}\r\n\r\n'),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(events=EVENTS, cuts=st.lists(st.integers(0, 400), max_size=8), pauses=st.data())
def test_every_byte_reaches_the_client_once_and_in_order(
    events: list[bytes], cuts: list[int], pauses: st.DataObject
) -> None:
    """However reads split the stream and whenever the client pauses, what was written and
    what was yielded, in order, are the engine's events, less the usage chunk."""
    body = b"".join(events) + DONE
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    reads = [body[a:b] for a, b in pairwise(bounds)]

    async def run() -> bytes:
        conn, _, stream = await open_stream()
        client = Client()
        stream.push_to(client.write)

        async def drain() -> None:
            async for block in stream:
                client.written.append(block)  # the caller's own write, in order

        reader = asyncio.ensure_future(drain())
        for data in reads:
            await settle()
            client.paused = pauses.draw(st.booleans())
            conn.data_received(piece(data))
        conn.data_received(b"0\r\n\r\n")
        await asyncio.wait_for(reader, 10)
        return b"".join(client.written)

    relayed = asyncio.run(run())
    expected = token("first") + b"".join(e for e in events if e != USAGE)
    # A read that ends between CR and LF ends that event at its CR (the LF is dropped): the
    # same events either way, and byte for byte when every event is LF-framed.
    assert [e.data for e in SseDecoder().feed(relayed)] == [
        e.data for e in SseDecoder().feed(expected)
    ]
    if b"\r" not in expected:
        assert relayed == expected
