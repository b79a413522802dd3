"""Releasing an abandoned handoff at once, through a consumer.

A vLLM 0.32 producer frees the blocks it holds for a remote decode only when a consumer
says it is done with them, or when the KV lease ends (`_reap_expired_send_leases`); it has
no route of its own to free them, and aborting the finished prefill does nothing. But a
consumer that turns a decode request away at its serving layer (any error answer from the
request handler, such as an unknown model) still tells the producer it is done, with no
blocks pulled (`_with_kv_transfer_rejection_cleanup` → `notify_kv_transfer_request_rejected`
→ an empty pull), and the producer frees the blocks on the spot.

So the router releases a handoff it will not decode by sending a consumer the descriptor
in a completion request for a model no engine serves: the consumer answers 404, pulls
nothing and frees the producer's blocks. The simulator does the same.
"""

from __future__ import annotations

import asyncio

import aiohttp

from narwhal.engines.client import EngineClient

# A model name no engine serves, so that a consumer turns the request away before any work.
RELEASE_MODEL = "narwhal-release-abandoned-handoff"


def release_body(descriptor: bytes) -> bytes:
    """A completion request carrying the producer's descriptor as it was received."""
    return (
        b'{"model":"' + RELEASE_MODEL.encode() + b'","prompt":"release","max_tokens":1,'
        b'"kv_transfer_params":' + descriptor + b"}"
    )


async def release_handoff(
    client: EngineClient, consumer_url: str, request_id: str, descriptor: bytes, timeout_s: float
) -> bool:
    """Ask a consumer to release a descriptor's blocks; True when it turned the request
    away as intended (a 404), False on any other answer or failure."""
    headers = {**client.headers, "X-Request-Id": request_id}
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.session.post(
                consumer_url + "/v1/completions", data=release_body(descriptor), headers=headers
            ) as response,
        ):
            await response.read()
            return response.status == 404
    except (TimeoutError, aiohttp.ClientError):
        return False
