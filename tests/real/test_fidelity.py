"""The recordings the simulator is held to (`tests/data/vllm/`) still describe the vLLM
installed here: the same cases, answered live by the real producer, agree with them."""

from __future__ import annotations

import aiohttp
import pytest

from support.fidelity import CASES, Case, capture, differences, load
from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

RECORDINGS = load()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_the_recording_matches_the_live_engine(real: RealStack, case: Case) -> None:
    async with aiohttp.ClientSession() as session:
        live = await capture(session, real.producer.url, case, MODEL)
    if case.name == "prefill":
        await real.wait_out_lease()  # nobody pulls this handoff
    assert differences(RECORDINGS[case.name], live) == []
