"""The KV handoff: a prefill on the producer, a decode that pulls the blocks on the consumer."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import pytest

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.model import tokenize

if TYPE_CHECKING:
    from tools.sim.conftest import Sim, Stream

PROMPT = "A narwhal's tusk is a tooth that grows through its upper lip, " * 3
PREFILL_PARAMS = prefill_request_params()
COMPLETION = ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "seed": 7})
CHAT = (
    "/v1/chat/completions",
    {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 12},
)


async def _prefill(sim: Sim, producer: SimEngine, path: str, body: dict[str, Any]) -> Any:
    """The router's first leg; returns the producer's descriptor."""
    leg = body | {"stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    status, answer = await sim.post(producer, path, leg)
    assert status == 200
    return answer["kv_transfer_params"]


async def _decode(
    sim: Sim, consumer: SimEngine, path: str, body: dict[str, Any], descriptor: Any
) -> Stream:
    return await sim.stream(consumer, path, body | {"kv_transfer_params": descriptor})


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
async def test_handoff_yields_the_text_the_producer_alone_yields(
    sim: Sim, path: str, body: dict[str, Any]
) -> None:
    producer, consumer = await sim.start(name="p"), await sim.start(name="d")
    alone = await sim.stream(producer, path, body)
    descriptor = await _prefill(sim, producer, path, body)
    assert producer.held_block_count() == len(_blocks(descriptor)) > 0
    handed_off = await _decode(sim, consumer, path, body, descriptor)
    assert handed_off.done
    assert handed_off.text == alone.text
    assert len(handed_off.output_events) == 12
    assert producer.held_block_count() == 0


async def test_descriptor_names_the_producer_and_its_side_channel(sim: Sim) -> None:
    producer = await sim.start(tp_size=2, side_channel_host="127.0.0.2")
    descriptor = await _prefill(sim, producer, *COMPLETION)
    assert descriptor["do_remote_prefill"] is True
    assert descriptor["do_remote_decode"] is False
    assert descriptor["remote_engine_id"] == producer.engine_id
    assert descriptor["remote_host"] == "127.0.0.2"
    assert descriptor["remote_port"] == producer.side_channel_port
    assert descriptor["tp_size"] == 2
    assert descriptor["remote_request_id"].startswith("cmpl-")
    assert len(_blocks(descriptor)) == math.ceil(len(tokenize(PROMPT)) / 16)


async def test_prefill_token_is_the_first_token_of_a_plain_run(sim: Sim) -> None:
    engine = await sim.start()
    path, body = COMPLETION
    leg = body | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    _, prefill = await sim.post(engine, path, leg)
    _, plain = await sim.post(engine, path, body)
    assert plain["choices"][0]["text"].startswith(prefill["choices"][0]["text"])


async def test_prefill_that_stops_on_eos_holds_nothing_and_has_a_null_descriptor(
    sim: Sim,
) -> None:
    producer = await sim.start(eos_probability=1.0)
    path, body = COMPLETION
    _, answer = await sim.post(
        producer, path, body | {"max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    )
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["kv_transfer_params"] is None
    assert producer.held_block_count() == 0


async def test_plain_requests_have_a_null_descriptor_field(sim: Sim) -> None:
    engine = await sim.start()
    _, answer = await sim.post(engine, *COMPLETION)
    assert answer["kv_transfer_params"] is None


def _blocks(descriptor: dict[str, Any]) -> list[int]:
    """The descriptor's block ids, flattened (it sends one list per KV-cache group)."""
    return [block for group in descriptor["remote_block_ids"] for block in group]


def _tamper_block_id(descriptor: dict[str, Any]) -> dict[str, Any]:
    return descriptor | {"remote_block_ids": [[b + 1 for b in _blocks(descriptor)]]}


def _tamper_engine_id(descriptor: dict[str, Any]) -> dict[str, Any]:
    return descriptor | {"remote_engine_id": "0" * 32}


def _tamper_request_id(descriptor: dict[str, Any]) -> dict[str, Any]:
    return descriptor | {"remote_request_id": "cmpl-somebody-else"}


@pytest.mark.parametrize("tamper", [_tamper_block_id, _tamper_engine_id, _tamper_request_id])
async def test_tampered_descriptor_fails_the_stream_with_policy_fail(sim: Sim, tamper: Any) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    stream = await _decode(sim, consumer, path, body, tamper(descriptor))
    assert stream.status == 200
    assert stream.output_events == []
    error = stream.events[-1]["error"]
    assert (error["type"], error["code"], error["param"]) == ("InternalServerError", 500, None)
    assert "KV transfer failed" in error["message"]
    assert stream.done
    assert producer.held_block_count() == len(_blocks(descriptor))
    assert consumer.running_count() == 0


@pytest.mark.parametrize("tamper", [_tamper_block_id, _tamper_engine_id])
async def test_tampered_descriptor_is_recomputed_with_policy_recompute(
    sim: Sim, tamper: Any
) -> None:
    producer = await sim.start()
    consumer = await sim.start(kv_load_failure_policy="recompute")
    path, body = COMPLETION
    alone = await sim.stream(producer, path, body)
    descriptor = await _prefill(sim, producer, path, body)
    stream = await _decode(sim, consumer, path, body, tamper(descriptor))
    assert stream.done
    assert stream.text == alone.text


async def test_reused_descriptor_fails_the_second_pull(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    first = await _decode(sim, consumer, path, body, descriptor)
    second = await _decode(sim, consumer, path, body, descriptor)
    assert first.text and first.done
    assert "error" in second.events[-1]
    assert "expired or pulled" in second.events[-1]["error"]["message"]


async def test_reused_descriptor_is_recomputed_with_policy_recompute(sim: Sim) -> None:
    producer = await sim.start()
    consumer = await sim.start(kv_load_failure_policy="recompute")
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    first = await _decode(sim, consumer, path, body, descriptor)
    second = await _decode(sim, consumer, path, body, descriptor)
    assert second.text == first.text


async def test_expired_descriptor_fails_and_frees_the_blocks(sim: Sim) -> None:
    producer, consumer = await sim.start(kv_lease_s=0.05), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    await sim.until(lambda: producer.held_block_count() == 0)
    stream = await _decode(sim, consumer, path, body, descriptor)
    assert "error" in stream.events[-1]


async def test_expired_descriptor_is_recomputed_with_policy_recompute(sim: Sim) -> None:
    producer = await sim.start(kv_lease_s=0.05)
    consumer = await sim.start(kv_load_failure_policy="recompute")
    path, body = COMPLETION
    alone = await sim.stream(producer, path, body)
    descriptor = await _prefill(sim, producer, path, body)
    await sim.until(lambda: producer.held_block_count() == 0)
    stream = await _decode(sim, consumer, path, body, descriptor)
    assert stream.text == alone.text


async def test_decode_of_another_prompt_fails_verification(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    other = body | {"prompt": PROMPT.replace("tusk", "fang")}
    stream = await _decode(sim, consumer, path, other, descriptor)
    assert "do not match the prompt" in stream.events[-1]["error"]["message"]


async def test_non_streaming_decode_with_failed_pull_is_a_500(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    status, answer = await sim.post(
        consumer, path, body | {"kv_transfer_params": _tamper_engine_id(descriptor)}
    )
    assert status == 500
    assert answer["error"]["code"] == 500


async def test_pull_from_an_unreachable_side_channel_fails(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    await producer.crash()
    stream = await _decode(sim, consumer, path, body, descriptor)
    assert "side channel" in stream.events[-1]["error"]["message"]


async def test_blocks_per_kv_cache_group_are_accepted(sim: Sim) -> None:
    producer, consumer = await sim.start(), await sim.start()
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    blocks = _blocks(descriptor)
    grouped = descriptor | {"remote_block_ids": [blocks[:1], blocks[1:]]}
    stream = await _decode(sim, consumer, path, body, grouped)
    assert stream.done and stream.text
    assert producer.held_block_count() == 0


async def test_kv_pull_costs_time_per_block_instead_of_prefill(sim: Sim) -> None:
    producer = await sim.start(prefill_s_per_token=0.01)
    consumer = await sim.start(prefill_s_per_token=0.01, kv_pull_s_per_block=0.001)
    path, body = COMPLETION
    descriptor = await _prefill(sim, producer, path, body)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await _decode(sim, consumer, path, body | {"max_tokens": 1}, descriptor)
    assert loop.time() - started < 0.2  # computing the prompt would take 0.4 s


async def test_crash_drops_held_blocks(sim: Sim) -> None:
    producer = await sim.start()
    await _prefill(sim, producer, *COMPLETION)
    assert producer.held_block_count() > 0
    await producer.crash()
    assert producer.held_block_count() == 0


async def test_a_prefill_aborted_before_it_answers_holds_nothing(sim: Sim) -> None:
    producer = await sim.start(prefill_s_per_token=0.005)  # ~0.25 s of prefill
    prefill = asyncio.create_task(_prefill(sim, producer, *COMPLETION))
    await sim.until(lambda: producer.running_count() == 1)
    prefill.cancel()
    await sim.until(lambda: producer.running_count() == 0)
    await asyncio.sleep(0.3)
    assert producer.held_block_count() == 0
    assert producer.waiting_count() == 0


ADAPTERS = (("sql", "/adapters/sql"), ("poet", "/adapters/poet"))
GREEDY = ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})


async def _lora_pair(sim: Sim, **consumer: Any) -> tuple[SimEngine, SimEngine]:
    producer = await sim.start(name="p", model="base", lora_modules=ADAPTERS)
    options = {"name": "d", "model": "base", "lora_modules": ADAPTERS} | consumer
    return producer, await sim.start(**options)


async def _alone(sim: Sim, engine: SimEngine, model: str) -> str:
    path, body = GREEDY
    return (await sim.stream(engine, path, body | {"model": model})).text


async def _handoff(
    sim: Sim, producer: SimEngine, consumer: SimEngine, prefill_model: str, decode_model: str
) -> tuple[Stream, Any]:
    path, body = GREEDY
    descriptor = await _prefill(sim, producer, path, body | {"model": prefill_model})
    stream = await _decode(sim, consumer, path, body | {"model": decode_model}, descriptor)
    return stream, descriptor


@pytest.mark.parametrize("model", ["base", "sql"])
async def test_a_handoff_within_one_adapter_answers_that_adapters_text(
    sim: Sim, model: str
) -> None:
    producer, consumer = await _lora_pair(sim)
    stream, descriptor = await _handoff(sim, producer, consumer, model, model)
    assert stream.done and stream.text == await _alone(sim, producer, model)
    adapter = None if model == "base" else model
    [handoff] = consumer.handoffs
    assert (handoff.producer_model, handoff.producer_adapter) == ("base", adapter)
    assert (handoff.consumer_model, handoff.consumer_adapter) == ("base", adapter)
    assert (handoff.blocks, handoff.ok) == (len(_blocks(descriptor)), True)
    assert handoff.request_id.startswith("cmpl-")
    assert handoff.remote_request_id == descriptor["remote_request_id"]
    assert handoff.producer_engine_id == producer.engine_id
    assert consumer.crossed_handoffs() == []


@pytest.mark.parametrize(("prefill", "decode"), [("sql", "poet"), ("base", "sql"), ("sql", "base")])
async def test_a_handoff_across_adapters_answers_a_text_wrong_for_both(
    sim: Sim, prefill: str, decode: str
) -> None:
    producer, consumer = await _lora_pair(sim)
    stream, _ = await _handoff(sim, producer, consumer, prefill, decode)
    assert stream.status == 200 and stream.done and stream.text
    assert stream.text not in (
        await _alone(sim, producer, prefill),
        await _alone(sim, consumer, decode),
    )
    assert producer.held_block_count() == 0
    [handoff] = consumer.crossed_handoffs()
    assert handoff.ok and handoff.crossed_adapter and not handoff.crossed_model
    assert (handoff.producer_adapter, handoff.consumer_adapter) == (
        None if prefill == "base" else prefill,
        None if decode == "base" else decode,
    )
    report = (await sim.get(consumer, "/sim/handoffs"))[1]
    assert b'"crossed_adapters":1' in report and b'"crossed_models":0' in report


async def test_a_handoff_across_base_models_fails_as_nixls_check_fails(sim: Sim) -> None:
    producer = await sim.start(name="p", model="base-a")
    consumer = await sim.start(name="d", model="base-b")
    stream, descriptor = await _handoff(sim, producer, consumer, "base-a", "base-b")
    assert stream.output_events == [] and stream.done
    error = stream.events[-1]["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert "KV transfer failed" in error["message"] and "compatibility" in error["message"]
    # No transfer: the producer keeps the blocks until its lease ends.
    assert producer.held_block_count() == len(_blocks(descriptor))
    [handoff] = consumer.handoffs
    assert (handoff.producer_model, handoff.consumer_model) == ("base-a", "base-b")
    assert handoff.crossed_model and not handoff.ok
    assert consumer.crossed_handoffs() == [handoff]


async def test_a_handoff_across_base_models_is_recomputed_with_policy_recompute(
    sim: Sim,
) -> None:
    producer = await sim.start(name="p", model="base-a")
    consumer = await sim.start(name="d", model="base-b", kv_load_failure_policy="recompute")
    stream, _ = await _handoff(sim, producer, consumer, "base-a", "base-b")
    assert stream.done and stream.text == await _alone(sim, consumer, "base-b")
    assert [h.crossed_model for h in consumer.handoffs] == [True]


@pytest.mark.parametrize("model", ["narwhal-release-abandoned-handoff", "poet"])
async def test_a_decode_for_a_model_not_served_is_a_404_that_releases_the_blocks(
    sim: Sim, model: str
) -> None:
    producer = await sim.start(name="p", model="base", lora_modules=ADAPTERS)
    consumer = await sim.start(name="d", model="base", lora_modules=ADAPTERS[:1])
    path, body = GREEDY
    descriptor = await _prefill(sim, producer, path, body | {"model": "sql"})
    assert producer.held_block_count() > 0
    status, answer = await sim.post(
        consumer, path, body | {"model": model, "kv_transfer_params": descriptor}
    )
    assert (status, answer["error"]["type"]) == (404, "NotFoundError")
    await sim.until(lambda: producer.held_block_count() == 0)
    assert list(consumer.handoffs) == []
