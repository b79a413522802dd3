"""Faults: their validation, how they are armed (flag, control route, header), what they do."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest

from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.faults import ArmedFaults, Fault, FaultError
from narwhal.tools.sim.options import SimOptions

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

PROMPT = "Which way do the narwhals swim when the ice closes over the bay?"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY = {"prompt": PROMPT, "max_tokens": 10}
CHAT_BODY = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def _header(**fault: Any) -> dict[str, str]:
    return {"x-sim-fault": orjson.dumps(fault).decode()}


async def _timed_events(
    sim: Sim, engine: SimEngine, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[float, list[tuple[float, bytes]]]:
    """Seconds until the response headers, and each SSE event with its arrival time."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = []
    url = engine.url + COMPLETIONS
    async with sim.session.post(url, json=body | {"stream": True}, headers=headers) as response:
        headers_at = loop.time() - started
        while not response.content.at_eof():
            event = await response.content.readuntil(b"\n\n")
            if event:
                events.append((loop.time() - started, event.strip()))
    return headers_at, events


# -- validation ------------------------------------------------------------------------------


def test_fault_json_round_trips() -> None:
    value = {"phase": "decode", "times": 2, "silence_after": 3, "silence_s": 1.5}
    assert Fault.from_json(value).to_json() == value


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"stauts": 500}, "stauts"),
        ({"status": "500"}, "status"),
        ({"status": 200}, "status"),
        ({"phase": "middle"}, "phase"),
        ({"times": 0}, "times"),
        ({"hang_s": -1}, "hang_s"),
        ({"close_after": True}, "close_after"),
        ({"crash": 1}, "crash"),
        ({"descriptor": "garbled"}, "descriptor"),
        ({"silence_after": 2}, "silence_s"),
    ],
)
def test_bad_fault_json_is_rejected_naming_the_key(value: dict[str, Any], named: str) -> None:
    with pytest.raises(FaultError, match=named):
        Fault.from_json(value)


def test_armed_fault_fires_on_its_phase_for_its_times() -> None:
    armed = ArmedFaults([Fault(phase="prefill", status=503, times=2)])
    assert armed.take("decode") is None
    assert armed.to_json() == [{"phase": "prefill", "status": 503, "times": 2}]
    assert armed.take("prefill") == armed.take("prefill") == Fault("prefill", 2, 503)
    assert armed.take("prefill") is None
    assert armed.to_json() == []


def test_first_matching_armed_fault_wins() -> None:
    armed = ArmedFaults([Fault(phase="prefill", status=503), Fault(status=500)])
    assert armed.take("decode") == Fault(status=500)
    assert armed.take("prefill") == Fault(phase="prefill", status=503)


# -- how faults are armed --------------------------------------------------------------------


async def test_control_route_is_404_without_faults_enabled(sim: Sim) -> None:
    engine = await sim.start()
    assert (await sim.get(engine, "/sim/faults"))[0] == 404
    async with sim.session.post(engine.url + "/sim/faults", json={"status": 500}) as response:
        assert response.status == 404


async def test_header_is_ignored_without_faults_enabled(sim: Sim) -> None:
    engine = await sim.start()
    status, _ = await sim.post(engine, COMPLETIONS, BODY, _header(status=503))
    assert status == 200


async def test_control_route_arms_reads_and_clears_a_fault(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    async with sim.session.post(engine.url + "/sim/faults", json={"status": 503}) as response:
        assert response.status == 200
    assert orjson.loads((await sim.get(engine, "/sim/faults"))[1]) == [{"status": 503}]
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 503
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 503
    async with sim.session.delete(engine.url + "/sim/faults") as response:
        assert response.status == 200
    assert orjson.loads((await sim.get(engine, "/sim/faults"))[1]) == []
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200


async def test_control_route_rejects_an_unknown_key_by_name(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    async with sim.session.post(engine.url + "/sim/faults", json={"hang": 1}) as response:
        body = await response.json()
    assert response.status == 400
    assert "'hang'" in body["error"]["message"]


async def test_times_expires_the_fault(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    await sim.session.post(engine.url + "/sim/faults", json={"status": 500, "times": 2})
    statuses = [(await sim.post(engine, COMPLETIONS, BODY))[0] for _ in range(3)]
    assert statuses == [500, 500, 200]
    assert orjson.loads((await sim.get(engine, "/sim/faults"))[1]) == []


async def test_startup_fault_is_armed(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True, faults=(Fault(status=429, times=1),))
    status, body = await sim.post(engine, COMPLETIONS, BODY)
    assert (status, body["error"]["type"]) == (429, "RateLimitError")
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200


async def test_header_fault_applies_to_its_request_only(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    status, body = await sim.post(engine, COMPLETIONS, BODY, _header(status=503))
    assert status == 503
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200


async def test_bad_header_fault_is_a_400(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    status, body = await sim.post(engine, COMPLETIONS, BODY, {"x-sim-fault": '{"nope": 1}'})
    assert status == 400
    assert "'nope'" in body["error"]["message"]


async def test_phase_selects_prefill_or_decode_requests(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    engine.set_fault(Fault(phase="prefill", status=503))
    prefill = BODY | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200
    assert (await sim.post(engine, COMPLETIONS, prefill))[0] == 503
    engine.set_fault(Fault(phase="decode", status=502))
    assert (await sim.post(engine, COMPLETIONS, prefill))[0] == 200
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 502
    engine.clear_faults()
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200


# -- what each fault does --------------------------------------------------------------------


async def test_hang_delays_the_response_headers(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    headers_at, events = await _timed_events(sim, engine, BODY, _header(hang_s=0.3))
    assert headers_at >= 0.29
    assert events[-1][1] == b"data: [DONE]"


async def test_first_token_delay_comes_after_the_headers(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True, faults=(Fault(first_token_delay_s=0.3),))
    headers_at, events = await _timed_events(sim, engine, BODY)
    assert headers_at < 0.2
    assert events[0][0] >= 0.29  # the event loop's clock is millisecond-grained


async def test_silence_pauses_the_stream_after_k_tokens(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    engine.set_fault(Fault(silence_after=3, silence_s=0.3))
    _, events = await _timed_events(sim, engine, BODY)
    times = [at for at, _ in events]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps.index(max(gaps)) == 2  # between token 3 and token 4
    assert max(gaps) >= 0.29
    assert len(events) == 11 and events[-1][1] == b"data: [DONE]"


async def test_silence_with_metadata_keeps_sending_keep_alive_comments(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    await sim.session.post(
        engine.url + "/sim/faults",
        json={"silence_after": 2, "silence_s": 0.35, "silence_metadata": True},
    )
    stream = await sim.stream(engine, COMPLETIONS, BODY)
    assert len(stream.comments) >= 3 and set(stream.comments) == {b": keep-alive"}
    assert len(stream.events) == len(stream.output_events) == 10
    chat = await sim.stream(
        engine, CHAT, CHAT_BODY, _header(silence_after=1, silence_s=0.25, silence_metadata=True)
    )
    assert len(chat.comments) >= 2 and chat.done


async def test_close_after_cuts_the_stream_without_done(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await sim.stream(engine, COMPLETIONS, BODY, _header(close_after=4))
    assert stream.broken
    assert not stream.done
    assert len(stream.output_events) == 4
    await sim.until(lambda: engine.running_count() == 0)


async def test_close_after_zero_on_a_non_streaming_request_drops_it(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    with pytest.raises(aiohttp.ClientError):
        await sim.post(engine, COMPLETIONS, BODY, _header(close_after=0))


async def test_done_before_token_ends_the_stream_empty(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    engine.set_fault(Fault(done_before_token=True))
    completions = await sim.stream(engine, COMPLETIONS, BODY)
    chat = await sim.stream(engine, CHAT, CHAT_BODY)
    assert completions.done and completions.events == []
    assert chat.done
    assert [event["choices"][0]["delta"] for event in chat.events] == [
        {"role": "assistant", "content": ""}
    ]


async def test_error_after_sends_an_error_object_inside_the_stream(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    stream = await sim.stream(engine, COMPLETIONS, BODY, _header(error_after=3, error_code=503))
    assert len(stream.output_events) == 3
    assert stream.events[-1] == {
        "error": {
            "message": "simulated fault: error after 3 tokens",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    assert stream.done


async def test_error_after_on_a_non_streaming_request_is_an_error_status(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    status, body = await sim.post(engine, COMPLETIONS, BODY, _header(error_after=2))
    assert (status, body["error"]["code"]) == (500, 500)


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        ("missing_engine_id", lambda d: "remote_engine_id" not in d),
        (
            "non_integer_block_ids",
            lambda d: all(isinstance(b, str) for b in d["remote_block_ids"][0]),
        ),
        ("negative_block_ids", lambda d: all(b < 0 for b in d["remote_block_ids"][0])),
        ("null", lambda d: d is None),
    ],
)
async def test_descriptor_fault_answers_a_malformed_descriptor_and_holds_nothing(
    sim: Sim, kind: str, check: Any
) -> None:
    engine = await sim.start(faults_enabled=True)
    prefill = BODY | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    status, answer = await sim.post(engine, COMPLETIONS, prefill, _header(descriptor=kind))
    assert status == 200
    assert check(answer["kv_transfer_params"])
    assert engine.held_block_count() == 0


async def test_malformed_descriptor_fails_the_decode(sim: Sim) -> None:
    producer = await sim.start(faults_enabled=True)
    consumer = await sim.start()
    producer.set_fault(Fault(descriptor="negative_block_ids"))
    prefill = BODY | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    _, answer = await sim.post(producer, COMPLETIONS, prefill)
    decode = BODY | {"kv_transfer_params": answer["kv_transfer_params"]}
    stream = await sim.stream(consumer, COMPLETIONS, decode)
    assert "malformed descriptor" in stream.events[-1]["error"]["message"]


async def _handoff(
    sim: Sim, producer: SimEngine, consumer: SimEngine, headers: dict[str, str] | None = None
) -> tuple[float, Any]:
    prefill = BODY | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    _, answer = await sim.post(producer, COMPLETIONS, prefill)
    loop = asyncio.get_running_loop()
    started = loop.time()
    decode = BODY | {"kv_transfer_params": answer["kv_transfer_params"]}
    stream = await sim.stream(consumer, COMPLETIONS, decode, headers)
    return loop.time() - started, stream


async def test_kv_pull_delay_slows_the_decode_while_blocks_stay_held(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start(faults_enabled=True)
    consumer.set_fault(Fault(kv_pull_delay_s=0.3))
    decode = asyncio.create_task(_handoff(sim, producer, consumer))
    await sim.until(lambda: producer.held_block_count() > 0)
    await asyncio.sleep(0.1)
    assert producer.held_block_count() > 0
    elapsed, stream = await decode
    assert elapsed >= 0.29
    assert stream.done and len(stream.output_events) == 10
    assert producer.held_block_count() == 0


async def test_kv_pull_fail_applies_the_failure_policy(sim: Sim) -> None:
    producer = await sim.start()
    failing = await sim.start(faults_enabled=True)
    recomputing = await sim.start(faults_enabled=True, kv_load_failure_policy="recompute")
    header = _header(kv_pull_fail=True)
    _, failed = await _handoff(sim, producer, failing, header)
    _, recomputed = await _handoff(sim, producer, recomputing, header)
    assert failed.events[-1]["error"]["message"].endswith("simulated fault: KV pull failed")
    assert recomputed.done and len(recomputed.output_events) == 10


async def test_refuse_stops_accepting_connections_for_a_while(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    engine.set_fault(Fault(refuse_s=0.4, times=1))
    with pytest.raises(aiohttp.ClientError):
        await sim.post(engine, COMPLETIONS, BODY)
    with pytest.raises(aiohttp.ClientConnectorError):
        await sim.post(engine, COMPLETIONS, BODY)
    await asyncio.sleep(0.5)
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 200


async def test_an_engine_tells_each_time_it_stops_and_starts_accepting_connections(
    sim: Sim,
) -> None:
    told: list[bool] = []
    engine = SimEngine(SimOptions(faults_enabled=True, inter_token_s=0.0), on_listening=told.append)
    sim.engines.append(engine)
    await engine.start()
    engine.set_fault(Fault(refuse_s=0.2, times=1))
    with pytest.raises(aiohttp.ClientError):
        await sim.post(engine, COMPLETIONS, BODY)
    assert told == [True, False]
    await sim.until(lambda: len(told) == 3)
    await engine.crash()
    await engine.restart()
    assert told == [True, False, True, False, True]


async def test_crash_fault_drops_everything_in_process(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True, inter_token_s=0.01)
    prefill = BODY | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    await sim.post(engine, COMPLETIONS, prefill)
    running = asyncio.create_task(sim.stream(engine, COMPLETIONS, BODY | {"max_tokens": 500}))
    await sim.until(lambda: engine.running_count() == 1)
    with pytest.raises(aiohttp.ClientError):
        await sim.post(engine, COMPLETIONS, BODY, _header(crash=True))
    assert (await running).broken
    assert engine.held_block_count() == 0
    assert engine.running_count() == 0
    with pytest.raises(aiohttp.ClientConnectorError):
        await sim.get(engine, "/health")


async def test_restart_comes_back_on_the_same_ports_as_a_new_engine(sim: Sim) -> None:
    engine = await sim.start(faults_enabled=True)
    old_id, old_url, old_side = engine.engine_id, engine.url, engine.side_channel_port
    old_metrics = (await sim.get(engine, "/metrics"))[1]
    await engine.crash()
    await engine.restart()
    assert (engine.url, engine.side_channel_port) == (old_url, old_side)
    assert engine.engine_id != old_id
    assert (await sim.get(engine, "/health"))[0] == 200
    new_metrics = (await sim.get(engine, "/metrics"))[1]
    start_line = next(line for line in old_metrics.splitlines() if line.startswith(b"process_"))
    assert start_line not in new_metrics


async def test_pinned_engine_id_survives_a_restart(sim: Sim) -> None:
    engine = await sim.start(engine_id="pinned")
    await engine.restart()
    assert engine.engine_id == "pinned"


async def test_fault_set_before_start_stays_armed(sim: Sim) -> None:
    engine = SimEngine(SimOptions(faults_enabled=True, inter_token_s=0.0))
    sim.engines.append(engine)
    engine.set_fault(Fault(status=503))
    await engine.start()
    assert (await sim.post(engine, COMPLETIONS, BODY))[0] == 503
