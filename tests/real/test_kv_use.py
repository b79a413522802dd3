"""Proof of KV use: the router's view of its consumer shows the crossed decodes it sent
and the prompt tokens the engine says it pulled for them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def kv_of(real: RealStack) -> dict[str, Any]:
    """The consumers' KV figures, summed: the router places the request on either."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(real.server.url + "/narwhal/state") as response,
    ):
        state = await response.json()
    kvs = [e["kv"] for e in state["engines"] if e["id"] in ("d0", "d1")]
    return {
        "crossed_decodes": sum(kv["crossed_decodes"] for kv in kvs),
        "pulled": sum(kv["prompt_tokens"].get("external_kv_transfer", 0) for kv in kvs),
        "computed": sum(kv["prompt_tokens"].get("local_compute", 0) for kv in kvs),
        "silent_recomputes": sum(kv["silent_recomputes"] for kv in kvs),
    }


async def settled_kv(real: RealStack) -> dict[str, Any]:
    """The consumers' figures once the router's reading of them has stopped changing: it
    reads engines' /metrics every two seconds, so a try's own figures may land late."""
    last = await kv_of(real)
    for _ in range(30):
        await asyncio.sleep(2.5)
        now = await kv_of(real)
        if now == last:
            return now
        last = now
    return last


async def test_crossed_decodes_show_as_prompt_tokens_the_consumer_pulled(real: RealStack) -> None:
    # As in test_handoff: a request the router had to retry (an expired handoff or a refused
    # connection on a loaded machine) proves no handoff, so it is asked again, twice at most.
    # A try that fell back computed its prompt on a consumer: the next one starts from
    # figures that include it.
    for attempt in range(3):
        before = await kv_of(real) if attempt == 0 else await settled_kv(real)
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
        kv = await kv_of(real)
        if kv["pulled"] > before["pulled"]:
            break
        await asyncio.sleep(0.1)
    assert kv["crossed_decodes"] > before["crossed_decodes"]
    # This decode's own figures: earlier tests (a consumer killed mid-answer, decodes that
    # timed out on a stalled CPU fleet) leave computed prompt tokens in the totals.
    pulled = kv["pulled"] - before["pulled"]
    computed = kv["computed"] - before["computed"]
    assert pulled > 0 and pulled / (pulled + computed) > 0.5, (kv, before)
    assert kv["silent_recomputes"] == before["silent_recomputes"], (kv, before)
