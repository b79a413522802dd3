"""The router's aiohttp server: its routes, authentication and the JSON shapes of its errors."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from narwhal.config.secrets import Secrets, bearer_allowed
from narwhal.fleet.served import listing
from narwhal.http.admin import add_admin_routes
from narwhal.http.aiohttp_reply import AiohttpReply
from narwhal.http.page import add_page_routes
from narwhal.http.responses import add_responses_routes
from narwhal.http.served import Served
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError

if TYPE_CHECKING:
    pass

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
    router: Served, secrets: Secrets, extra: Sequence[Middleware] = ()
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

    async def responses(request: web.Request) -> web.StreamResponse:
        reply = AiohttpReply(request)
        await router.handle(reply, Endpoint.RESPONSES)
        return reply.response

    async def models(request: web.Request) -> web.StreamResponse:
        body = listing(router.fleet, config.lora, created)
        return web.Response(body=orjson.dumps(body), content_type="application/json")

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

    app.router.add_post(Endpoint.COMPLETIONS.value, completions)
    app.router.add_post(Endpoint.CHAT.value, chat)
    app.router.add_post(Endpoint.RESPONSES.value, responses)
    add_responses_routes(app, router)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/narwhal/state", state)
    app.router.add_get("/metrics", metrics)
    add_page_routes(app)
    add_admin_routes(app, router.operations, router.abandoned, router.admission)
    return app
