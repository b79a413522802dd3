"""A minimal prefill/decode proxy on FastAPI and httpx, as a peer for the router benchmark.

It has the design of vLLM's disaggregated proxy example, written from the engine contract:
one shared `httpx.AsyncClient`; per request a one-token, non-streaming prefill on the
producer with `kv_transfer_params`, then the client's own body with the producer's
descriptor on the consumer, whose bytes are relayed as they come (streaming) or returned
whole. No retries, no seats, no health tracking: only what a proxy of this design pays per
request and per token, so the benchmark can compare a router with it.

It runs in the benchmark's own venv (`make bench-setup`), never in Narwhal's:

    .venv-bench/bin/python benchmarks/peers/fastapi_proxy.py \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

or `uvicorn benchmarks.peers.fastapi_proxy:app` with the engines' URLs in
`FASTAPI_PROXY_PREFILL` and `FASTAPI_PROXY_DECODE`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill leg asks the producer for: hold the prompt's blocks for a remote pull."""

KEEPALIVE_S = 4.0
"""Idle pooled connections are dropped before vLLM's own 5 s limit closes them under us."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the producer's one-token, non-streaming prefill (contract leg 1)."""
    prefill = {
        key: value
        for key, value in body.items()
        if key not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    prefill.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def descriptor(answer: Any) -> Any:
    """The producer's descriptor: top-level, or inside `choices[0]` on some versions."""
    if not isinstance(answer, dict):
        return None
    found = answer.get("kv_transfer_params")
    if found is None:
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            found = choices[0].get("kv_transfer_params")
    return found


def create_app(prefill_url: str, decode_url: str) -> FastAPI:
    """The proxy's app; the client lives for the app's lifetime so connections are pooled."""
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        # No cap on connections: a cap would queue streams in the proxy, not in the engine.
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=512, keepalive_expiry=KEEPALIVE_S
        )
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            state["client"] = client
            yield

    def route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            client = state["client"]
            body = await request.json()
            headers = {"X-Request-Id": uuid.uuid4().hex}
            prefill = await client.post(
                prefill_url + path, json=prefill_body(body), headers=headers
            )
            if prefill.status_code != 200:
                return _relay_whole(prefill)
            decode = dict(body)
            kv = descriptor(prefill.json())
            if kv is not None:
                decode["kv_transfer_params"] = kv
            if not body.get("stream", False):
                return _relay_whole(
                    await client.post(decode_url + path, json=decode, headers=headers)
                )
            request_out = client.build_request(
                "POST", decode_url + path, json=decode, headers=headers
            )
            response = await client.send(request_out, stream=True)
            if response.status_code != 200:
                await response.aread()
                await response.aclose()
                return _relay_whole(response)
            return StreamingResponse(_relay(response), media_type="text/event-stream")

        return handle

    app = FastAPI(lifespan=lifespan)
    app.add_api_route("/v1/completions", route("/v1/completions"), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route("/v1/chat/completions"), methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    return app


async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
    """The consumer's stream as it arrives; closing it aborts the engine's request."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


def _relay_whole(response: httpx.Response) -> Response:
    media = response.headers.get("content-type", "application/json")
    return Response(response.content, status_code=response.status_code, media_type=media)


async def _health() -> Response:
    return Response(status_code=200)


app = create_app(
    os.environ.get("FASTAPI_PROXY_PREFILL", "http://127.0.0.1:8100"),
    os.environ.get("FASTAPI_PROXY_DECODE", "http://127.0.0.1:8200"),
)


def main() -> None:
    """Serve on uvicorn with uvloop and httptools; access logs off, as a peer's would be."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prefill", required=True, help="the producer's base URL")
    parser.add_argument("--decode", required=True, help="the consumer's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(
        create_app(args.prefill.rstrip("/"), args.decode.rstrip("/")),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
