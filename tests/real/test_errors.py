"""A client's bad request gets vLLM's own answer through the router: status, message, type,
code and the `param` naming the field, as the engine alone would give it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Past the tiny model's 2,048-token context whatever the tokenizer does.
TOO_LONG = " ".join(["whale"] * 6000)
CASES = {
    "prompt too long": {"prompt": TOO_LONG, "max_tokens": 4},
    "max_tokens past the context": {"prompt": "The sea is", "max_tokens": 10**7},
    "stream_options without streaming": {
        "prompt": "The sea is",
        "max_tokens": 4,
        "stream_options": {"include_usage": True},
    },
}


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json={"model": MODEL, **body}) as response,
    ):
        return response.status, await response.json()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_bad_request_gets_the_engines_own_error_through_the_router(
    real: RealStack, case: str
) -> None:
    direct_status, direct = await post(real.producer.url, CASES[case])
    status, routed = await post(real.server.url, CASES[case])
    if case == "max_tokens past the context":
        await real.wait_out_lease()  # the prefill's handoff was never pulled
    assert direct_status == 400 and status == 400
    assert routed["error"]["param"] == direct["error"]["param"] is not None
    assert routed["error"]["code"] == direct["error"]["code"] == 400
    if case != "stream_options without streaming":
        # The engine's answer, relayed as sent; the router refuses the last case itself.
        assert routed["error"] == direct["error"]
