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

from narwhal.tools.sim.engine import SimEngine
from support.fidelity import CASES, Case, capture, differences, load
from tools.sim.conftest import FAST

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


def _stream(*deltas: dict[str, str]) -> dict[str, object]:
    """A chat stream's capture: a token event for every delta but the last, then the final."""
    events: list[object] = [
        {"choices": [{"delta": delta, "finish_reason": None}]} for delta in deltas[:-1]
    ]
    events.append({"choices": [{"delta": deltas[-1], "finish_reason": "length"}]})
    events.append("[DONE]")
    raw = "".join(f"data: {event}\n\n" for event in events)
    return {"status": 200, "content_type": "text/event-stream", "raw": raw, "events": events}


def test_reasoning_and_content_text_are_one_member() -> None:
    # What the tiny model writes differs by machine: thinking on one, a reply on another.
    real = _stream({"reasoning": "A"}, {"reasoning": "."})
    assert differences(real, _stream({}, {"content": "A"}, {})) == []


def test_a_token_event_without_any_text_member_is_still_found() -> None:
    real = _stream({"reasoning": "A"}, {"reasoning": "."})
    assert sorted(differences(real, _stream({"other": "A"}, {}))) == [
        "token.choices[0].delta.other: the simulator sends it, vLLM does not",
        "token.choices[0].delta.text: vLLM sends it, the simulator does not",
    ]
