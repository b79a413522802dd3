"""A bulk read wakes its reader once a marker is whole, wherever the pieces split it, and
not before: fed piece by piece through the connection's own HTTP parser."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from narwhal.engines.http import Connection, Origin

MARKERS = (b"[DONE]", b'"error"')
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKEN = b'data: {"choices":[{"text":"a"}]}\n\n'


class Transport:
    """Enough of a transport for a connection that is fed by hand."""

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        pass


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def connection() -> Connection:
    conn = Connection(cast(Any, None), Origin.of("http://127.0.0.1:1"))
    conn.connection_made(cast(Any, Transport()))
    conn.send(b"POST /v1/completions HTTP/1.1\r\n\r\n")
    conn.data_received(HEAD)
    assert await conn.head() == 200
    return conn


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("marked", [b"data: [DONE]\n\n", b'data: {"error":{"code":503}}\n\n'])
@pytest.mark.parametrize("cut", range(1, 26))
async def test_the_reader_wakes_once_the_marker_is_whole(marked: bytes, cut: int) -> None:
    conn = await connection()
    reading = asyncio.create_task(conn.read_bulk(MARKERS, 1 << 20, lambda: None))
    for _ in range(5):
        conn.data_received(piece(TOKEN))
    await settle()
    assert not reading.done()
    # The marked event in three pieces: the marker may be split anywhere.
    first, second = marked[:cut], marked[cut : cut + 3]
    rest = marked[cut + 3 :]
    ends = (cut, cut + 3, len(marked))
    whole_after = next(n for n, end in enumerate(ends) if any(m in marked[:end] for m in MARKERS))
    for n, part in enumerate((first, second, rest)):
        if part:
            conn.data_received(piece(part))
        await settle()
        assert reading.done() == (n >= whole_after), (n, whole_after)
        if n == whole_after:
            break
    # What was held when it woke: everything up to the piece that made the marker whole.
    assert reading.result() == TOKEN * 5 + marked[: ends[whole_after]]


async def test_the_reader_wakes_at_the_limit_and_at_the_end() -> None:
    conn = await connection()
    reading = asyncio.create_task(conn.read_bulk(MARKERS, 3 * len(TOKEN), lambda: None))
    conn.data_received(piece(TOKEN) * 2)
    await settle()
    assert not reading.done()
    conn.data_received(piece(TOKEN))
    await settle()
    assert reading.result() == TOKEN * 3
    reading = asyncio.create_task(conn.read_bulk(MARKERS, 1 << 20, lambda: None))
    conn.data_received(piece(TOKEN) + b"0\r\n\r\n")
    await settle()
    assert reading.result() == TOKEN
