"""The Responses API's read and delete routes: stored responses by id, as their tenant sees
them (`POST /v1/responses` itself is the request path's, served like the other routes)."""

from __future__ import annotations

import orjson
from aiohttp import web

from narwhal.http.served import Served
from narwhal.protocol.errors import NarwhalError
from narwhal.router.responses import input_items_page


def add_responses_routes(app: web.Application, router: Served) -> None:
    conversations = router.conversations

    def tenant(request: web.Request) -> str | None:
        admission = router.admission
        if admission is None:
            return None
        found = admission.tenant(request.headers.get("Authorization"))
        return None if found is None else found.name

    async def retrieve(request: web.Request) -> web.StreamResponse:
        try:
            record = await conversations.read(request.match_info["id"], tenant(request))
        except NarwhalError as error:
            return _error(error)
        return web.Response(body=record.response, content_type="application/json")

    async def delete(request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        try:
            await conversations.delete(response_id, tenant(request))
        except NarwhalError as error:
            return _error(error)
        body = {"id": response_id, "object": "response", "deleted": True}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def input_items(request: web.Request) -> web.StreamResponse:
        try:
            record = await conversations.read(request.match_info["id"], tenant(request))
            page = input_items_page(record, dict(request.query))
        except NarwhalError as error:
            return _error(error)
        return web.Response(body=orjson.dumps(page), content_type="application/json")

    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)
    app.router.add_get("/v1/responses/{id}/input_items", input_items)


def _error(error: NarwhalError) -> web.Response:
    return web.Response(
        status=error.status,
        body=error.json(),
        content_type="application/json",
        headers=error.headers(),
    )
