"""The router's HTTP surface: routes, JSON error shapes, and running the server."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from narwhal.config.root import Config
from narwhal.config.secrets import Secrets, bearer_allowed
from narwhal.fleet.seat_share import SeatShare
from narwhal.http.admin import add_admin_routes
from narwhal.http.aiohttp_reply import AiohttpReply
from narwhal.http.front import Front
from narwhal.http.page import add_page_routes
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.pipeline import Router

if TYPE_CHECKING:
    from narwhal.observe.tracing import Tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404/405 answers, re-shaped as OpenAI errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = NarwhalError(exc.status, exc.reason, Cause.BAD_REQUEST)
        return web.Response(status=exc.status, body=error.json(), content_type="application/json")


# Health, and the fleet page's own files: they hold no data (the page asks for the admin
# key when `/narwhal/state` needs one).
OPEN_PATHS = frozenset({"/health", "/", "/narwhal", "/narwhal/"})


def authentication(secrets: Secrets) -> Middleware:
    """Bearer keys: client keys for `/v1/*`, admin keys for operator data; see `OPEN_PATHS`.

    A kind of route with no keys configured is open.
    """

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path.startswith("/narwhal/static/"):
            keys: tuple[bytes, ...] = ()
        elif path.startswith("/v1/"):
            keys = secrets.client_keys
        else:
            keys = secrets.admin_keys
        if keys and not bearer_allowed(request.headers.get("Authorization"), keys):
            error = NarwhalError(
                401,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
                Cause.BAD_REQUEST,
            )
            return web.Response(
                status=401,
                body=error.json(),
                content_type="application/json",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return authenticate


def build_app(
    router: Router, secrets: Secrets, extra: Sequence[Middleware] = ()
) -> web.Application:
    """`extra` middlewares run after authentication (a worker's fan-out to its peers)."""
    config = router.config
    middlewares: list[Middleware] = [openai_errors]
    if secrets.client_keys or secrets.admin_keys:
        middlewares.insert(0, authentication(secrets))
    middlewares[-1:-1] = extra
    app = web.Application(client_max_size=config.serving.max_request_bytes, middlewares=middlewares)
    created = int(time.time())

    async def completions(request: web.Request) -> web.StreamResponse:
        reply = AiohttpReply(request)
        await router.handle(reply, Endpoint.COMPLETIONS)
        return reply.response

    async def chat(request: web.Request) -> web.StreamResponse:
        reply = AiohttpReply(request)
        await router.handle(reply, Endpoint.CHAT)
        return reply.response

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model,
                        "object": "model",
                        "created": created,
                        "owned_by": "narwhal",
                    }
                ],
            }
        )

    async def health(request: web.Request) -> web.StreamResponse:
        if router.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        if router.fleet.can_serve():
            return web.json_response({"status": "degraded" if router.fleet.degraded() else "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def state(request: web.Request) -> web.StreamResponse:
        return web.Response(body=orjson.dumps(router.state()), content_type="application/json")

    async def metrics(request: web.Request) -> web.StreamResponse:
        body, content_type = router.metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app.router.add_post(Endpoint.COMPLETIONS.value, completions)
    app.router.add_post(Endpoint.CHAT.value, chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/narwhal/state", state)
    app.router.add_get("/metrics", metrics)
    add_page_routes(app)
    add_admin_routes(app, router.operations, router.abandoned)
    app.cleanup_ctx.append(lifespan)
    return app


class RouterServer:
    """A running router bound to a socket; `port` is the real one when 0 was asked."""

    def __init__(
        self,
        config: Config,
        host: str | None = None,
        port: int | None = None,
        *,
        secrets: Secrets | None = None,
        config_path: Path | None = None,
        tracing: Tracing | None = None,
        listener: socket.socket | None = None,
        peer_path: str | None = None,
        middlewares: Sequence[Middleware] = (),
        journal_stamp: Mapping[str, object] | None = None,
        seat_share: SeatShare | None = None,
    ) -> None:
        """`config_path` is the file a reload (SIGHUP, `POST /narwhal/reload`) re-reads.
        `tracing`: a tracer of the caller's (tests give one that keeps spans in memory);
        by default `[tracing]` and the OTEL_* environment decide. A worker process passes
        its bound `listener` (shared with the other workers), the Unix socket path its peers
        reach it at, its fan-out middleware, the keys it stamps on its journal lines and its
        part of the seat limits."""
        self.secrets = secrets or Secrets()
        self.router = Router(
            config,
            self.secrets,
            config_path,
            tracing=tracing,
            journal_stamp=journal_stamp,
            seat_share=seat_share,
        )
        self.host = host if host is not None else config.server.host
        self.port = port if port is not None else config.server.port
        self._listener = listener
        self._peer_path = peer_path
        self._middlewares = tuple(middlewares)
        self._runner: web.AppRunner | None = None
        self._front: Front | None = None
        self._listening: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        # The keep-alive timer runs from a connection's opening (or last answer) until a
        # request's headers are complete: it bounds idle and slow-header clients alike.
        self._runner = web.AppRunner(
            build_app(self.router, self.secrets, self._middlewares),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.router.config.server.client_timeout_s,
        )
        await self._runner.setup()
        aiohttp = self._runner.server
        assert aiohttp is not None
        # Client connections meet the fast lane first; it hands aiohttp the rest.
        self._front = Front(self.router, aiohttp, self.secrets.client_keys)
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            self._listening = await loop.create_server(
                self._front, sock=self._listener, backlog=4096
            )
            self.port = self._listener.getsockname()[1]
        else:
            self._listening = await loop.create_server(
                self._front, self.host, self.port, backlog=4096, reuse_address=True
            )
            if self.port == 0:
                self.port = bound_port(self._listening)
        if self._peer_path is not None:
            await web.UnixSite(self._runner, self._peer_path).start()

    async def stop(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        if self._front is not None:
            self._front.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def shutdown(self, grace_s: float) -> None:
        """Drain (new requests get 503, running ones get `grace_s` to finish), then stop."""
        await self.router.drain(grace_s)
        await self.stop()


def bound_port(listening: web.TCPSite | asyncio.AbstractServer) -> int:
    server = listening._server if isinstance(listening, web.TCPSite) else listening
    # asyncio's and uvloop's servers both expose `sockets`.
    sockets = getattr(server, "sockets", None)
    if not sockets:
        raise RuntimeError("the router's listening socket is not open")
    port: int = sockets[0].getsockname()[1]
    return port


def stop_signal() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM; install it before announcing readiness, so that a
    signal sent right after the announcement drains instead of killing the process."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def reload_signal(server: RouterServer) -> None:
    """SIGHUP re-reads the config file and applies its engine list (see `operations`)."""
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, server.router.operations.reload_and_log
    )
