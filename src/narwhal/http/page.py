"""The fleet page: static assets shipped in the package, drawn from `/narwhal/state`.

Served from memory with a same-origin content policy: the page works on machines with no
network beyond the router, and nothing on it can load from elsewhere.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

ASSET_TYPES = {"fleet.js": "text/javascript", "fleet.css": "text/css"}
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
}


def add_page_routes(app: web.Application) -> None:
    """`GET /`, `/narwhal` and `/narwhal/` serve the page; its assets sit under
    `/narwhal/static/`."""
    static = resources.files("narwhal.http") / "static"
    index = (static / "index.html").read_bytes()
    assets = {name: (static / name).read_bytes() for name in ASSET_TYPES}

    async def page(request: web.Request) -> web.StreamResponse:
        return web.Response(body=index, content_type="text/html", charset="utf-8", headers=HEADERS)

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in assets:
            raise web.HTTPNotFound()
        return web.Response(
            body=assets[name], content_type=ASSET_TYPES[name], charset="utf-8", headers=HEADERS
        )

    for path in ("/", "/narwhal", "/narwhal/"):
        app.router.add_get(path, page)
    app.router.add_get("/narwhal/static/{name}", asset)
