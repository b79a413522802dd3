"""Faults on `POST /v1/responses`, with the meaning each has for a Responses stream.

vLLM 0.32 has no error event on this route: an error during a stream (a failed KV pull, an
engine that died) ends the connection with the chunked body unfinished, after whatever events
were sent (tests/data/vllm/responses_stream_kv_failure.json). So `error_after` cuts a stream
there too, and a failed pull cuts it after `response.in_progress`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest

from narwhal.tools.sim.faults import Fault
from tools.sim.test_responses_api import (
    BODY,
    EVENT_ORDER,
    PREFILL_PARAMS,
    RESPONSES,
    read_stream,
    text_of,
)

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

DELTA = "response.output_text.delta"
OPENING = ["response.created", "response.in_progress"]


def _header(**fault: Any) -> dict[str, str]:
    return {"x-sim-fault": orjson.dumps(fault).decode()}


async def test_a_status_fault_answers_that_error(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    status, answer = await sim.post(engine, RESPONSES, BODY, _header(status=503))
    stream = await read_stream(sim, engine, BODY, _header(status=429))
    assert (status, answer["error"]["type"], answer["error"]["code"]) == (
        503,
        "ServiceUnavailableError",
        503,
    )
    assert (stream.status, stream.error["error"]["code"]) == (429, 429)


async def test_hang_delays_the_headers(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await read_stream(sim, engine, BODY, _header(hang_s=0.3))
    assert stream.headers_at >= 0.29
    assert stream.types[-1] == "response.completed"


async def test_first_token_delay_comes_after_the_response_is_created(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True, faults=(Fault(first_token_delay_s=0.4),))
    stream = await read_stream(sim, engine, BODY)
    assert stream.types[:2] == OPENING
    first_delta = stream.types.index(DELTA)
    # created and in_progress go out before the engine takes the request, the text later.
    assert stream.times[first_delta] - stream.times[1] >= 0.39
    assert stream.types[-1] == "response.completed"


@pytest.mark.parametrize("metadata", [False, True])
async def test_silence_pauses_between_deltas_without_keep_alives(sim: Sim, metadata: bool) -> None:
    engine = await sim.start(faults_enabled=True)
    fault = _header(silence_after=3, silence_s=0.3, silence_metadata=metadata)
    stream = await read_stream(sim, engine, BODY, fault)
    times = [at for at, kind in zip(stream.times, stream.types, strict=True) if kind == DELTA]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps.index(max(gaps)) == 2  # between delta 3 and delta 4
    assert max(gaps) >= 0.29
    assert len(times) == 12
    # vLLM 0.32 sends no SSE keep-alive comments on this route.
    assert stream.comments == []
    assert stream.types[-1] == "response.completed"


async def test_close_after_cuts_the_stream_after_k_deltas(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await read_stream(sim, engine, BODY, _header(close_after=4))
    assert stream.broken
    assert stream.types == EVENT_ORDER + [DELTA] * 4
    await sim.until(lambda: engine.running_count() == 0)


async def test_close_after_on_a_whole_response_drops_it(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    with pytest.raises(aiohttp.ClientError):
        await sim.post(engine, RESPONSES, BODY, _header(close_after=0))


async def test_done_before_token_completes_the_response_with_no_output(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    engine.set_fault(Fault(done_before_token=True))
    stream = await read_stream(sim, engine, BODY)
    assert not stream.broken
    assert stream.types == [*OPENING, "response.completed"]
    final = stream.completed
    assert (final["status"], final["output"]) == ("completed", [])
    assert final["usage"]["output_tokens"] == 0
    assert [event["sequence_number"] for event in stream.events] == [0, 1, 2]


async def test_error_after_cuts_the_stream_as_vllm_does_an_error(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await read_stream(sim, engine, BODY, _header(error_after=3, error_code=503))
    assert stream.broken
    assert stream.types == EVENT_ORDER + [DELTA] * 3  # no error event, no completed
    await sim.until(lambda: engine.running_count() == 0)


async def test_error_after_on_a_whole_response_is_an_error_status(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    status, answer = await sim.post(engine, RESPONSES, BODY, _header(error_after=2))
    assert (status, answer["error"]["code"], answer["error"]["type"]) == (
        500,
        500,
        "InternalServerError",
    )


async def test_crash_after_drops_the_stream_and_the_engine(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await read_stream(sim, engine, BODY, _header(crash_after=2))
    assert stream.broken
    assert stream.types == EVENT_ORDER + [DELTA] * 2
    with pytest.raises(aiohttp.ClientConnectorError):
        await sim.get(engine, "/health")


async def test_a_descriptor_fault_shapes_the_prefill_s_descriptor(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    leg = BODY | {"max_output_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    _, answer = await sim.post(engine, RESPONSES, leg, _header(descriptor="missing_engine_id"))
    assert "remote_engine_id" not in answer["kv_transfer_params"]
    assert engine.held_block_count() == 0


async def _decode(
    sim: Sim, producer: Any, consumer: Any, fault: dict[str, Any], *, stream: bool
) -> Any:
    leg = BODY | {"max_output_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    _, prefill = await sim.post(producer, RESPONSES, leg)
    decode = BODY | {"kv_transfer_params": prefill["kv_transfer_params"]}
    if stream:
        return await read_stream(sim, consumer, decode, _header(**fault))
    return await sim.post(consumer, RESPONSES, decode, _header(**fault))


async def test_a_failed_pull_cuts_a_stream_after_in_progress(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start(faults_enabled=True)
    stream = await _decode(sim, producer, consumer, {"kv_pull_fail": True}, stream=True)
    assert (stream.status, stream.broken, stream.types) == (200, True, OPENING)
    await sim.until(lambda: consumer.running_count() == 0)


async def test_a_failed_pull_of_a_whole_response_is_a_500(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start(faults_enabled=True)
    status, answer = await _decode(sim, producer, consumer, {"kv_pull_fail": True}, stream=False)
    assert (status, answer["error"]["type"], answer["error"]["param"]) == (
        500,
        "InternalServerError",
        None,
    )


async def test_a_failed_pull_is_recomputed_under_the_recompute_policy(sim: Sim) -> None:
    producer = await sim.start()
    consumer = await sim.start(faults_enabled=True, kv_load_failure_policy="recompute")
    _, alone = await sim.post(producer, RESPONSES, BODY)
    stream = await _decode(sim, producer, consumer, {"kv_pull_fail": True}, stream=True)
    assert stream.text == text_of(alone)
    assert stream.types[-1] == "response.completed"


async def test_a_slow_pull_delays_the_first_delta(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start(faults_enabled=True)
    stream = await _decode(sim, producer, consumer, {"kv_pull_delay_s": 0.3}, stream=True)
    assert stream.times[stream.types.index(DELTA)] - stream.times[1] >= 0.29
    assert stream.types[-1] == "response.completed"
    assert producer.held_block_count() == 0
