"""The client's side of one request, as the request path sees it: headers and a body in, one
answer out (an event stream, or a whole response).

Two servers carry client requests: aiohttp for every route (`http.aiohttp_reply`), and the
fast lane for the two OpenAI routes in their usual form (`http.front`). The request path
writes through this interface alone, so both answer alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from narwhal.protocol.errors import NarwhalError, client_error

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Reply(Protocol):
    """One request's client connection. Writes raise `ConnectionResetError` once the client
    has gone."""

    def header(self, name: str) -> str | None:
        """A request header (case-insensitive name), or None."""
        ...

    async def body(self, timeout_s: float) -> bytes:
        """The whole request body; a 413 or 408 `NarwhalError` when it is too large or does
        not arrive within `timeout_s`."""
        ...

    @property
    def committed(self) -> bool:
        """Whether a 200 event stream has begun (errors then go in-band)."""
        ...

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        """Commit a 200 event stream; its head goes out with the first bytes written."""
        ...

    async def write(self, data: bytes) -> None:
        """Bytes of the committed stream."""
        ...

    def writer(self) -> Callable[[bytes], bool] | None:
        """A write of the committed stream that does not wait, where this reply has one:
        called from a transport read, it returns False once the client's writes are paused."""
        ...

    async def end(self, data: bytes = b"") -> None:
        """The last bytes of the committed stream, and its end."""
        ...

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        """A whole JSON response; with `close`, the connection ends once it is sent."""
        ...


def body_too_large(limit: int) -> NarwhalError:
    return client_error(413, f"request body exceeds {limit} bytes (serving.max_request_bytes)")


def body_too_slow(timeout_s: float) -> NarwhalError:
    return client_error(
        408, f"request body not received within {timeout_s:g} s (server.client_timeout_s)"
    )
