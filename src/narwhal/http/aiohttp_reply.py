"""The request path's `Reply` for a request aiohttp parsed (every route but the fast lane's)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from aiohttp import web

from narwhal.router.reply import body_too_large, body_too_slow
from narwhal.runtime.clock import clock


class SseResponse(web.StreamResponse):
    """An event stream whose headers go out with its first bytes: one write, not two."""

    _send_headers_immediately = False


class AiohttpReply:
    """A request aiohttp parsed; `response` is what its handler returns to aiohttp."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self._response: web.StreamResponse | None = None
        self._stream: web.StreamResponse | None = None

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)

    async def body(self, timeout_s: float) -> bytes:
        request = self.request
        try:
            if request.content.is_eof():
                # The usual case: the body came with the headers, and no timer is needed.
                return await request.read()
            async with clock().timeout(timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise body_too_large(request.client_max_size) from None
        except TimeoutError:
            raise body_too_slow(timeout_s) from None

    @property
    def committed(self) -> bool:
        return self._stream is not None

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        stream = SseResponse(headers=headers)
        await stream.prepare(self.request)
        self._stream = self._response = stream

    async def write(self, data: bytes) -> None:
        assert self._stream is not None
        await self._stream.write(data)

    def writer(self) -> None:
        return None  # aiohttp's writes wait

    async def end(self, data: bytes = b"") -> None:
        assert self._stream is not None
        await self._stream.write_eof(data)

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        response = web.Response(
            status=status, body=body, content_type="application/json", headers=headers
        )
        self._response = response
        if close:
            # Sent now and the connection closed, rather than linger reading the rest.
            with contextlib.suppress(ConnectionResetError):
                await response.prepare(self.request)
                await response.write_eof()
            self.request.protocol.force_close()

    @property
    def response(self) -> web.StreamResponse:
        """What was answered; a client that left before any answer gets a 499 (never sent)."""
        return self._response or web.Response(status=499)
