"""The relay writes what has arrived together, but never holds back output: tokens that came
in the same read as an error object reach the client before its terminal error event, and
a stream's last tokens come with [DONE] and the end of the answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from narwhal.app.server import RouterServer, bound_port
from narwhal.config.root import parse_config
from narwhal.protocol.sse import SseDecoder
from support.fake_engine import prefill_answer
from support.stack import MODEL

PREFILL = prefill_answer()
TOKENS = ("The", " sea", " is", " deep")


def event(payload: object) -> bytes:
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


def token(text: str) -> bytes:
    return event({"id": "cmpl-d", "object": "text_completion", "choices": [{"text": text}]})


async def engines(decode: bytes) -> AsyncIterator[tuple[str, str]]:
    """A producer answering every prefill, and a consumer writing `decode` in one write."""

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=PREFILL, content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(decode)
        await response.write_eof()
        return response

    runners = []
    urls = []
    for handler in (prefill, stream):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{bound_port(site)}")
    try:
        yield urls[0], urls[1]
    finally:
        for runner in runners:
            await runner.cleanup()


@asynccontextmanager
async def router_over(decode: bytes) -> AsyncIterator[str]:
    async for producer, consumer in engines(decode):
        config = parse_config(
            {
                "model": MODEL,
                "engines": [
                    {"id": "p0", "url": producer, "role": "prefill"},
                    {"id": "d0", "url": consumer, "role": "decode"},
                ],
            }
        )
        router = RouterServer(config, port=0)
        await router.start()
        try:
            yield router.url
        finally:
            await router.stop()


async def streamed(url: str) -> list[Any]:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    return [e.data if e.data == b"[DONE]" else orjson.loads(e.data) for e in SseDecoder().feed(raw)]


async def test_tokens_read_with_an_error_object_reach_the_client_before_its_error() -> None:
    error = {"error": {"message": "engine fault", "code": 503}}
    decode = b"".join([*(token(text) for text in TOKENS), event(error)])
    async with router_over(decode) as url:
        events = await streamed(url)
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert texts == list(TOKENS)
    assert events[-2]["error"]["code"] == 503
    assert events[-1] == b"[DONE]"


async def test_a_stream_read_whole_reaches_the_client_whole_and_ends_with_done() -> None:
    decode = b"".join([*(token(text) for text in TOKENS), event(b"[DONE]")])
    async with router_over(decode) as url:
        events = await streamed(url)
    assert [e["choices"][0]["text"] for e in events[:-1]] == list(TOKENS)
    assert events[-1] == b"[DONE]"
