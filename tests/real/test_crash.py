"""A real consumer that crashes (its whole process group SIGKILLed) is ejected by the
router, and once restarted on the same ports readmission puts it back in service."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from real_support import FIGURES, MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The sea is"


async def routed_status(real: RealStack) -> int:
    """The HTTP status the router answers for one small completion."""
    try:
        await real.openai().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0
        )
    except openai.APIStatusError as error:
        return error.status_code
    return 200


async def test_a_crashed_consumer_is_ejected_then_readmitted_after_restart(
    real: RealStack,
) -> None:
    await real.consumer.kill()
    started = time.monotonic()
    # Three failed decodes eject it (recovery.eject_after); then no engine can decode.
    statuses = [await routed_status(real) for _ in range(4)]
    FIGURES["4 requests after the consumer crashed"] = f"{time.monotonic() - started:.1f} s"
    assert statuses == [502, 502, 502, 503]
    assert await real.engine_state("d0") == "ejected"

    await real.consumer.restart()
    FIGURES["consumer restart"] = f"{real.consumer.start_seconds:.1f} s"
    started = time.monotonic()
    # Readmission runs every 10 s: /health, then a real handoff probe through it.
    for _ in range(180):
        if await real.engine_state("d0") == "admitted":
            break
        await asyncio.sleep(1)
    assert await real.engine_state("d0") == "admitted"
    FIGURES["readmitted after restart"] = f"{time.monotonic() - started:.1f} s"

    routed = await real.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0
    )
    alone = await real.direct(real.producer).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0
    )
    assert routed.choices[0].text == alone.choices[0].text
