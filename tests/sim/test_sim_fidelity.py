"""The simulator answers the fidelity cases in the shapes real vLLM answered them with.

The recordings in `tests/data/vllm/` come from real vLLM (`make record-vllm`); each case is
sent to a simulated engine set up as the recorded one was (CPU, a reasoning parser), and the two
answers must agree member by member, event kind by event kind, in status and framing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio

from fidelity import CASES, Case, capture, differences, load
from narwhal.sim.engine import SimEngine
from sim.conftest import FAST

RECORDINGS = load()
MODEL = "narwhal-sim"


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[SimEngine]:
    # Recorded with a reasoning parser on, whose tiny model was still thinking when its six
    # tokens ran out: every chat token is reasoning.
    engine = SimEngine(replace(FAST, model=MODEL, device="cpu", reasoning_tokens=64))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_the_simulator_answers_as_vllm_did(engine: SimEngine, case: Case) -> None:
    async with aiohttp.ClientSession() as session:
        simulated = await capture(session, engine.url, case, MODEL)
    assert differences(RECORDINGS[case.name], simulated) == []


def test_the_comparison_finds_a_missing_member_and_a_changed_type() -> None:
    real = {"status": 200, "content_type": "application/json", "json": {"a": 1, "b": "x"}}
    sim = {"status": 200, "content_type": "application/json", "json": {"a": "1"}}
    assert sorted(differences(real, sim)) == [
        "body.a: vLLM number, simulator str",
        "body.b: vLLM sends it, the simulator does not",
    ]
