"""An abandoned handoff released through a consumer is freed by the real producer at once:
of two prefills nobody decodes, the released one never reaches the end of its lease, the
other does (vLLM logs each lease that runs out).

The consumer passes a release on at its next scheduler step, so one more request to it
stands for the traffic a consumer in service always has."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from narwhal.engines.client import EngineClient, new_request_id
from narwhal.engines.release import release_handoff
from narwhal.protocol.bodies import Endpoint
from real_support import KV_LEASE_S, MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXPIRED = "Releasing expired KV blocks for request {}"


async def test_a_released_handoff_is_freed_before_its_lease_ends(real: RealStack) -> None:
    body = {"model": MODEL, "prompt": "The whales sing under grey skies", "max_tokens": 8}
    async with EngineClient(prefill_timeout_s=120.0) as client:
        released = await client.prefill(
            real.producer.url, Endpoint.COMPLETIONS, body, request_id=new_request_id()
        )
        kept = await client.prefill(
            real.producer.url, Endpoint.COMPLETIONS, body, request_id=new_request_id()
        )
        assert released.descriptor is not None and kept.descriptor is not None
        freed = await release_handoff(
            client, real.consumer.url, released.request_id, released.descriptor, 60.0
        )
    assert freed, "the consumer turned the release away with a 404"
    step = await real.direct(real.consumer).completions.create(
        model=MODEL, prompt="The sea is", max_tokens=1
    )
    assert step.choices[0].text is not None
    await real.wait_out_lease()
    log = real.producer.log_path.read_text(errors="replace")
    for _ in range(20):  # the producer reaps expired leases on its own schedule
        if EXPIRED.format(_remote_id(kept.descriptor)) in log:
            break
        await asyncio.sleep(1)
        log = real.producer.log_path.read_text(errors="replace")
    assert EXPIRED.format(_remote_id(kept.descriptor)) in log, "the kept handoff expired"
    assert EXPIRED.format(_remote_id(released.descriptor)) not in log, (
        f"the released handoff was freed before its {KV_LEASE_S} s lease ended"
    )


def _remote_id(descriptor: bytes) -> str:
    value = orjson.loads(descriptor)["remote_request_id"]
    assert isinstance(value, str)
    return value
