"""The fast lane on the router's listener: the usual client request served off the socket,
every other one handed to aiohttp at its first byte, on the same connection."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

from support.stack import COMPLETION, Stack, StackFactory, settled, sse_payloads


async def _open(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(stack.server.host, stack.server.port)


def _post(route: str, body: dict[str, Any], *extra: str) -> bytes:
    data = json.dumps(body).encode()
    head = [f"POST {route} HTTP/1.1", "Host: router", "Content-Type: application/json"]
    head += [*extra, f"Content-Length: {len(data)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case names) and its de-chunked body."""
    status_line = await asyncio.wait_for(reader.readline(), 30)
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n"
    assert await reader.readexactly(2) == b"\r\n"
    return status, headers, body


def _lane(headers: dict[str, str]) -> str:
    """Which server answered: aiohttp names itself, the fast lane does not."""
    return "aiohttp" if "aiohttp" in headers.get("server", "") else "fast"


async def test_requests_of_every_kind_share_one_keep_alive_connection(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        reader, writer = await _open(stack)
        stream = {**COMPLETION, "stream": True}
        writer.write(_post("/v1/completions", stream))
        status, headers, body = await _response(reader)
        assert status == 200 and _lane(headers) == "fast"
        assert headers["content-type"] == "text/event-stream"
        assert body.endswith(b"data: [DONE]\n\n")
        assert "".join(p["choices"][0]["text"] for p in sse_payloads(body.decode())) != ""
        # Another route on the same connection: aiohttp takes the connection from here on.
        writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        status, headers, body = await _response(reader)
        assert status == 200 and _lane(headers) == "aiohttp"
        assert json.loads(body)["status"] == "ok"
        writer.write(_post("/v1/completions", COMPLETION))
        status, headers, body = await _response(reader)
        assert status == 200 and _lane(headers) == "aiohttp"
        assert json.loads(body)["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
        writer.close()
        lines = await stack.journal(expect=2, kind="request")
        assert [line["status"] for line in lines] == [200, 200]
        await settled(stack)


async def test_pipelined_requests_are_answered_in_order(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        reader, writer = await _open(stack)
        bodies = [{**COMPLETION, "max_tokens": n, "stream": n % 2 == 0} for n in (2, 3, 4)]
        writer.write(b"".join(_post("/v1/completions", body) for body in bodies))
        for body in bodies:
            status, headers, raw = await _response(reader)
            assert status == 200 and _lane(headers) == "fast"
            if body["stream"]:
                texts = [
                    p["choices"][0]["text"] for p in sse_payloads(raw.decode()) if p["choices"]
                ]
                assert len(texts) == body["max_tokens"]
            else:
                assert json.loads(raw)["usage"]["completion_tokens"] == body["max_tokens"]
        writer.close()
        await stack.journal(expect=3, kind="request")
        await settled(stack)


async def test_unusual_requests_are_aiohttps_and_answered_as_before(
    make_stack: StackFactory,
) -> None:
    async with make_stack(serving={"max_request_bytes": 4096}) as stack:
        data = json.dumps(COMPLETION).encode()
        squeezed = gzip.compress(data)
        unusual = {
            "chunked": (
                b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
            ),
            "gzip": (
                b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(squeezed), squeezed)
            ),
            "query": _post("/v1/completions?trace=1", COMPLETION),
            "http/1.0": _post("/v1/completions", COMPLETION).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        }
        for name, request in unusual.items():
            reader, writer = await _open(stack)
            writer.write(request)
            status, headers, body = await _response(reader)
            assert status == 200, (name, body)
            assert _lane(headers) == "aiohttp", name
            writer.close()
        # Over the size limit: aiohttp's answer, with the router's own words.
        reader, writer = await _open(stack)
        writer.write(_post("/v1/completions", {**COMPLETION, "prompt": "x" * 5000}))
        status, headers, body = await _response(reader)
        assert status == 413 and _lane(headers) == "aiohttp"
        assert "4096 bytes (serving.max_request_bytes)" in json.loads(body)["error"]["message"]
        writer.close()
        await stack.journal(expect=5, kind="request")
        await settled(stack)


async def test_a_fast_lane_error_is_json_with_the_request_id(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        reader, writer = await _open(stack)
        writer.write(_post("/v1/completions", {**COMPLETION, "model": "nope"}))
        status, headers, body = await _response(reader)
        assert status == 404 and _lane(headers) == "fast"
        assert headers["content-type"] == "application/json"
        assert len(headers["x-request-id"]) == 32
        assert "nope" in json.loads(body)["error"]["message"]
        # The connection stays open for the next request.
        writer.write(_post("/v1/completions", COMPLETION))
        status, _, _ = await _response(reader)
        assert status == 200
        writer.close()
        await settled(stack)


async def test_connection_close_from_the_client_ends_the_connection(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        reader, writer = await _open(stack)
        writer.write(_post("/v1/completions", COMPLETION, "Connection: close"))
        status, headers, _ = await _response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        await settled(stack)
