"""A collector stand-in for the benchmark: accepts OTLP/HTTP trace exports and drops them.

The traced router then pays for everything tracing costs it, up to and including sending
each batch, while nothing is kept. It runs in the bench's own process, not the router's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def otlp_sink() -> AsyncIterator[tuple[str, list[int]]]:
    """The traces URL to export to, and a one-item list counting export requests."""
    exports = [0]

    async def accept(request: web.Request) -> web.Response:
        await request.read()
        exports[0] += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", accept)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/traces", exports
    finally:
        await runner.cleanup()
