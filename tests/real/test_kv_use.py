"""Proof of KV use: the router's view of its consumer shows the crossed decodes it sent
and the prompt tokens the engine says it pulled for them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from real_support import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def kv_of(real: RealStack, engine: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(real.server.url + "/narwhal/state") as response,
    ):
        state = await response.json()
    kv: dict[str, Any] = next(e for e in state["engines"] if e["id"] == engine)["kv"]
    return kv


async def test_crossed_decodes_show_as_prompt_tokens_the_consumer_pulled(real: RealStack) -> None:
    # As in test_handoff: a request the router had to retry (an expired handoff or a refused
    # connection on a loaded machine) proves no handoff, so it is asked again, twice at most.
    for _ in range(3):
        before = await kv_of(real, "d0")
        request_id = f"kv-use-{uuid.uuid4().hex}"
        answer = await real.openai().completions.create(
            model=MODEL,
            prompt="The whales sing under grey skies and",
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Request-Id": request_id},
        )
        assert answer.choices[0].text
        entry = await real.journal_entry(request_id)
        if (entry["handoff"], entry["attempts"]) == ("crossed", 1):
            break
    else:
        raise AssertionError(f"no request crossed in three tries: {entry}")
    for _ in range(200):  # the router reads engines' /metrics every two seconds here
        kv = await kv_of(real, "d0")
        pulled = kv["prompt_tokens"].get("external_kv_transfer", 0)
        if pulled > before["prompt_tokens"].get("external_kv_transfer", 0):
            break
        await asyncio.sleep(0.1)
    assert kv["crossed_decodes"] > before["crossed_decodes"]
    assert pulled > before["prompt_tokens"].get("external_kv_transfer", 0)
    assert kv["transfer_share"] > 0.5 and kv["silent_recomputes"] == 0
