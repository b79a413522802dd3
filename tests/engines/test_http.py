"""The legs' HTTP client: keep-alive reuse, chunked bodies, and how transport faults surface."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from narwhal.engines.http import (
    ConnectFailed,
    ConnectionBroken,
    ConnectionPool,
    TooLarge,
    request_bytes,
)

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.startswith(b"Content-Length")
    )
    return head + await reader.readexactly(length)


def answering(*answers: bytes, close_after: bool = False) -> Reply:
    """Answer each request on a connection with the next answer; False ends the connection."""
    queue = list(answers)

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_request(reader)
        writer.write(queue.pop(0) if len(queue) > 1 else queue[0])
        await writer.drain()
        return not close_after

    return reply


@asynccontextmanager
async def server(reply: Reply) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback HTTP server; yields its URL and a one-item list counting connections."""
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while await reply(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        listener.close()


async def post(pool: ConnectionPool, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    origin = pool.origin(url)
    connection = await pool.send(origin, request_bytes("/v1/x", origin, b"", "rid", body))
    try:
        return connection.status, await connection.read_all(1 << 20)
    finally:
        connection.release()


async def test_keep_alive_connections_are_reused() -> None:
    async with server(answering(OK)) as (url, connections):
        pool = ConnectionPool(connect_timeout_s=1)
        for _ in range(5):
            assert await post(pool, url) == (200, b"ok")
        pool.close()
    assert connections[0] == 1


async def test_a_connection_the_server_closes_is_not_reused() -> None:
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    async with server(answering(closing, close_after=True)) as (url, connections):
        pool = ConnectionPool(connect_timeout_s=1)
        for _ in range(3):
            assert await post(pool, url) == (200, b"ok")
        pool.close()
    assert connections[0] == 3


async def test_a_pooled_connection_closed_while_idle_is_replaced_transparently() -> None:
    async with server(answering(OK, close_after=True)) as (url, connections):
        pool = ConnectionPool(connect_timeout_s=1)
        assert await post(pool, url) == (200, b"ok")
        await asyncio.sleep(0.05)  # the server has closed the idle connection by now
        assert await post(pool, url) == (200, b"ok")
        pool.close()
    assert connections[0] == 2


async def test_chunked_bodies_arrive_de_chunked() -> None:
    async with server(answering(CHUNKED)) as (url, _):
        pool = ConnectionPool(connect_timeout_s=1)
        assert await post(pool, url) == (200, b"hello world")
        pool.close()


async def test_the_request_is_one_well_formed_post() -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        seen.append(await read_request(reader))
        writer.write(OK)
        return True

    async with server(record) as (url, _):
        pool = ConnectionPool(connect_timeout_s=1)
        origin = pool.origin(url)
        data = request_bytes(
            "/v1/completions", origin, b"Authorization: Bearer k\r\n", "id7", b"{}"
        )
        connection = await pool.send(origin, data)
        await connection.read_all(100)
        connection.release()
        pool.close()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert set(lines[1:]) == {
        b"Host: " + url.removeprefix("http://").encode(),
        b"Content-Length: 2",
        b"X-Request-Id: id7",
        b"Authorization: Bearer k",
    }
    assert body == b"{}"


async def test_a_refused_connection_is_connect_failed() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    pool = ConnectionPool(connect_timeout_s=1)
    with pytest.raises(ConnectFailed):
        await post(pool, f"http://127.0.0.1:{port}")


async def test_an_answer_that_is_not_http_breaks_the_connection() -> None:
    async with server(answering(b"SSH-2.0-OpenSSH\r\n\r\n")) as (url, _):
        pool = ConnectionPool(connect_timeout_s=1)
        with pytest.raises(ConnectionBroken, match="malformed HTTP response"):
            await post(pool, url)


async def test_a_body_cut_short_breaks_the_connection() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with server(answering(cut, close_after=True)) as (url, _):
        pool = ConnectionPool(connect_timeout_s=1)
        with pytest.raises(ConnectionBroken, match="closed before the answer ended"):
            await post(pool, url)


async def test_a_body_over_the_limit_is_too_large() -> None:
    async with server(answering(CHUNKED)) as (url, _):
        pool = ConnectionPool(connect_timeout_s=1)
        origin = pool.origin(url)
        connection = await pool.send(origin, request_bytes("/", origin, b"", "r", b"{}"))
        with pytest.raises(TooLarge):
            await connection.read_all(4)
        connection.close()


async def test_a_reused_connection_cancelled_before_its_answer_is_closed() -> None:
    closed = asyncio.Event()

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_request(reader)
        if not closed.is_set() and connections[0] == 1 and answered:
            # The second request on the kept connection: never answered; the client's
            # end of it shows as the connection's end.
            try:
                await reader.read()
            finally:
                closed.set()
            return False
        answered.append(True)
        writer.write(OK)
        await writer.drain()
        return True

    answered: list[bool] = []
    async with server(reply) as (url, connections):
        pool = ConnectionPool(connect_timeout_s=1)
        assert await post(pool, url) == (200, b"ok")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await post(pool, url)
        async with asyncio.timeout(5):
            await closed.wait()
        # Nothing of it is left to reuse: the next request opens a new connection.
        assert await post(pool, url) == (200, b"ok")
        assert connections[0] == 2
        pool.close()
