"""A handoff older than the producer's KV lease is never decoded: vLLM would pull blocks
that may hold another request's KV by then, and still answer 200."""

from __future__ import annotations

import aiohttp
import pytest

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from support.real import MODEL, RealStack, counter

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_handoff_past_the_lease_is_refused_before_the_consumer_sees_it(
    real: RealStack,
) -> None:
    # A lease so short that every handoff is older than its bound when the prefill returns.
    config = parse_config(
        {
            "model": MODEL,
            "engine": {"kv_lease_s": 0.01, "first_token_timeout_s": 60.0},
            "engines": [{"id": e.name, "url": e.url, "role": e.role} for e in real.fleet],
        }
    )
    server = RouterServer(config, port=0)
    await server.start()
    seen = await counter(real.consumer, "vllm:prompt_tokens_total")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 4}
            async with http.post(server.url + "/v1/completions", json=body) as response:
                status, answer = response.status, await response.json()
    finally:
        await server.stop()
    await real.wait_out_lease()  # the prefill's handoff was never pulled
    assert status == 504
    assert answer["error"]["message"].startswith("handoff expired: the descriptor from engine p0")
    assert answer["error"]["message"].endswith("its decode was not sent")
    assert await counter(real.consumer, "vllm:prompt_tokens_total") == seen
