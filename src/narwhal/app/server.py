"""The running process: the router built, both client-facing servers bound to one socket.

Client connections meet the fast lane (`http.front`) first; it hands every request it
does not serve itself, from that request's first byte, to the aiohttp application
(`http.app`). Both serve the same `Router`.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Middleware

from narwhal.app.process import Hooks, Router
from narwhal.config.root import Config
from narwhal.config.secrets import Secrets
from narwhal.fleet.seat_share import SeatShare
from narwhal.http.app import build_app
from narwhal.http.front import Front
from narwhal.tenants.store import LimitStore

if TYPE_CHECKING:
    from narwhal.observe.tracing import Tracing


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
        hooks: Hooks | None = None,
        limit_store: LimitStore | None = None,
    ) -> None:
        """`config_path` is the file a reload (SIGHUP, `POST /narwhal/reload`) re-reads.
        `tracing`: a tracer of the caller's (tests give one that keeps spans in memory);
        by default `[tracing]` and the OTEL_* environment decide. A worker process passes
        its bound `listener` (shared with the other workers), the Unix socket path its peers
        reach it at, its fan-out middleware, the keys it stamps on its journal lines, its
        part of the seat limits, its ledger's hooks and the tenants' limits it shares."""
        self.secrets = secrets or Secrets()
        self.router = Router(
            config,
            self.secrets,
            config_path,
            tracing=tracing,
            journal_stamp=journal_stamp,
            seat_share=seat_share,
            hooks=hooks,
            limit_store=limit_store,
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
        await self.router.start()
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
            await self.router.stop()

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
