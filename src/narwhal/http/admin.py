"""The admin API: operators change the live fleet over HTTP, behind the admin key.

| route                                   | does                                          |
|-----------------------------------------|-----------------------------------------------|
| `POST /narwhal/engines`                 | add an engine (body: one `[[engines]]` entry) |
| `POST /narwhal/engines/{id}/drain`      | drain it (`?force=true` past a phase floor)   |
| `POST /narwhal/engines/{id}/readmit`    | end its drain                                 |
| `PATCH /narwhal/engines/{id}`           | change `role`, seat limits or `pin`           |
| `DELETE /narwhal/engines/{id}`          | delete a drained engine                       |
| `POST /narwhal/reload`                  | re-read the config file (as SIGHUP does)      |
| `PATCH /narwhal/tenants/{name}`         | change a tenant's band, weight or limits      |

Answers are the engine as `/narwhal/state` shows it, or an OpenAI-shaped error whose
`param` names the body key at fault and whose `problems` lists every problem; the rules
are `operations`'. Every path here is under `/narwhal/`, which `app.authentication`
guards with `server.admin_api_keys`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from narwhal.fleet.operations import FleetOperations, OperationError
from narwhal.fleet.table import Engine
from narwhal.observe.state import engine_entry, tenant_settings
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.abandoned import AbandonedHandoffs
from narwhal.router.admission import Admission

Action = Callable[[web.Request], Awaitable[Any]]


def add_admin_routes(
    app: web.Application,
    operations: FleetOperations,
    abandoned: AbandonedHandoffs,
    admission: Admission | None = None,
) -> None:
    """`admission`: tenants' settings, changed by `PATCH /narwhal/tenants/{name}` (a
    router without `[[tenants]]` answers 409 there)."""

    def _show(engine: Engine) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        return {"engine": engine_entry(engine, now, abandoned)}

    async def add(request: web.Request) -> Any:
        return _show(operations.add(await _body(request)))

    async def drain(request: web.Request) -> Any:
        return _show(operations.drain(request.match_info["id"], force=_force(request)))

    async def readmit(request: web.Request) -> Any:
        return _show(operations.readmit(request.match_info["id"]))

    async def patch(request: web.Request) -> Any:
        engine = operations.patch(
            request.match_info["id"], await _body(request), force=_force(request)
        )
        return _show(engine)

    async def delete(request: web.Request) -> Any:
        engine_id = request.match_info["id"]
        operations.delete(engine_id)
        return {"removed": engine_id}

    async def reload(request: web.Request) -> Any:
        return operations.reload()

    async def tenant(request: web.Request) -> Any:
        if admission is None:
            raise OperationError(409, "this router has no [[tenants]]: add them and restart")
        changed = admission.change(request.match_info["name"], await _body(request))
        return {"tenant": {"name": changed.name, **tenant_settings(changed)}}

    app.router.add_post("/narwhal/engines", _answer(add, created=True))
    app.router.add_post("/narwhal/engines/{id}/drain", _answer(drain))
    app.router.add_post("/narwhal/engines/{id}/readmit", _answer(readmit))
    app.router.add_patch("/narwhal/engines/{id}", _answer(patch))
    app.router.add_delete("/narwhal/engines/{id}", _answer(delete))
    app.router.add_post("/narwhal/reload", _answer(reload))
    app.router.add_patch("/narwhal/tenants/{name}", _answer(tenant))


def _answer(
    action: Action, *, created: bool = False
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """JSON in and out; a refused change becomes its status and an error body."""

    async def handler(request: web.Request) -> web.Response:
        try:
            result = await action(request)
        except OperationError as error:
            body = NarwhalError(
                error.status, error.message, Cause.BAD_REQUEST, param=error.param
            ).body()
            body["error"]["problems"] = list(error.problems or (error.message,))
            return _json(body, error.status)
        return _json(result, 201 if created else 200)

    return handler


def _json(body: Any, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _force(request: web.Request) -> bool:
    return request.query.get("force", "").lower() in ("1", "true", "yes")


async def _body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise OperationError(400, f"the body is not valid JSON: {error}") from None
