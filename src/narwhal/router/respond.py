"""The client's side of a request: its body read, its answer written (a relayed stream,
one assembled answer, or an error), in the shapes an OpenAI client expects."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.leg_errors import bad_stream
from narwhal.protocol.errors import NarwhalError, client_error
from narwhal.protocol.sse import SseError
from narwhal.router.assemble import answer_body
from narwhal.router.assemble_typed import gathered_answer
from narwhal.router.call import Call

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE_EVENT = b"data: [DONE]\n\n"


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    try:
        if request.content.is_eof():
            # The usual case: the body came with the headers, and no timer is needed.
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise client_error(
            413,
            f"request body exceeds {request.client_max_size} bytes (serving.max_request_bytes)",
        ) from None
    except TimeoutError:
        raise client_error(
            408, f"request body not received within {timeout_s:g} s (server.client_timeout_s)"
        ) from None


class SseResponse(web.StreamResponse):
    """An event stream whose headers go out with its first bytes: one write, not two."""

    _send_headers_immediately = False


async def relay(request: web.Request, call: Call, stream: DecodeStream) -> web.StreamResponse:
    """Commit the 200 (output exists by now) and forward engine bytes as they come.

    Each block holds everything that had arrived; the last one goes with [DONE] and the
    end of the answer, so a stream costs as few writes as the engine's reads allow.
    """
    response = SseResponse(headers={**SSE_HEADERS, "X-Request-Id": call.request_id})
    await response.prepare(request)
    call.committed = response
    last = b""
    async for data in stream:
        if stream.done:
            last = data
        else:
            await response.write(data)
    call.output_tokens = completion_tokens(stream.usage)
    call.status = 200
    await response.write_eof(last + DONE_EVENT)
    return response


async def collect(stream: DecodeStream, call: Call) -> web.Response:
    """The whole stream, then one answer shaped as the engine's own non-streaming one.

    The stream is gathered in bulk; the usual one is checked and assembled in one parse
    (`gathered_answer`), any other decided event by event and folded (`answer_body`).
    """
    endpoint = call.endpoint
    gathered = await stream.rest(lambda events: gathered_answer(endpoint, events))
    if isinstance(gathered, tuple):
        body, usage = gathered
    else:
        try:
            body, usage = answer_body(endpoint, gathered, stream.usage_chunk, stream.usage)
        except SseError as exc:
            # Relayed events only had their framing checked; here each must parse.
            raise bad_stream(exc, stream.engine) from None
    call.output_tokens = completion_tokens(usage)
    call.status = 200
    return web.Response(
        body=body, content_type="application/json", headers={"X-Request-Id": call.request_id}
    )


def completion_tokens(usage: dict[str, Any] | None) -> int | None:
    tokens = (usage or {}).get("completion_tokens")
    return tokens if type(tokens) is int else None


async def answer_error(request: web.Request, call: Call, error: NarwhalError) -> web.StreamResponse:
    """An HTTP error before the 200; a terminal SSE error event after it."""
    if call.committed is None:
        response = web.Response(
            status=error.status,
            body=error.json(),
            content_type="application/json",
            headers={"X-Request-Id": call.request_id, **error.headers()},
        )
        if error.status == 408:
            # A client too slow to send its body gets no more time: close once the answer
            # is out, rather than linger reading the rest.
            with contextlib.suppress(ConnectionResetError):
                await response.prepare(request)
                await response.write_eof()
            request.protocol.force_close()
        return response
    try:
        await call.committed.write(error.sse_event())
        await call.committed.write_eof()
    except ConnectionResetError:
        pass
    return call.committed
