"""The simulator answers as vLLM 0.32 does: tokens without text, reasoning, the descriptor's
members, the block size of the device, usage details and the metrics a router may read."""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

import pytest

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.sim.kv import HeldBlocks
from narwhal.sim.model import tokenize

if TYPE_CHECKING:
    from narwhal.sim.engine import SimEngine
    from sim.conftest import Sim

PROMPT = "The narwhal dives under the ice to find its food in the dark, " * 3
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY = {"prompt": PROMPT, "max_tokens": 24}
CHAT_BODY = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10}
PREFILL = {"stream": False, "max_tokens": 1, "kv_transfer_params": prefill_request_params()}


async def descriptor_of(sim: Sim, producer: SimEngine, body: dict[str, Any]) -> Any:
    status, answer = await sim.post(producer, COMPLETIONS, body | PREFILL)
    assert status == 200
    return answer["kv_transfer_params"]


async def metric(sim: Sim, engine: SimEngine, series: str) -> float:
    async with sim.session.get(engine.url + "/metrics") as response:
        text = await response.text()
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in /metrics"
    return float(match.group(1))


async def test_tokens_that_detokenize_to_nothing_still_get_an_event_each(sim: Sim) -> None:
    engine = await sim.start(empty_token_probability=0.4)
    stream = await sim.stream(engine, COMPLETIONS, BODY)
    texts = [event["choices"][0]["text"] for event in stream.events]
    assert len(texts) == 24 and "" in texts and any(texts)
    _, whole = await sim.post(engine, COMPLETIONS, BODY)
    assert whole["choices"][0]["text"] == "".join(texts)
    assert whole["usage"]["completion_tokens"] == 24
    chat = await sim.stream(engine, CHAT, CHAT_BODY)
    deltas = [event["choices"][0]["delta"] for event in chat.events[1:]]
    assert len(deltas) == 10 and {"content": ""} in deltas


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
async def test_a_reasoning_parser_streams_the_first_tokens_as_reasoning(
    sim: Sim, field: str
) -> None:
    engine = await sim.start(reasoning_tokens=4, reasoning_field=field)
    body = CHAT_BODY | {"stream_options": {"include_usage": True}}
    stream = await sim.stream(engine, CHAT, body)
    deltas = [event["choices"][0]["delta"] for event in stream.events[1:-1]]
    assert [list(delta) for delta in deltas] == [[field]] * 4 + [["content"]] * 6
    assert stream.events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    _, whole = await sim.post(engine, CHAT, CHAT_BODY)
    message = whole["choices"][0]["message"]
    assert message[field] == "".join(delta[field] for delta in deltas[:4])
    assert message["content"] == "".join(delta["content"] for delta in deltas[4:])
    assert list(message)[-1] == field


async def test_a_completion_never_reasons(sim: Sim) -> None:
    engine = await sim.start(reasoning_tokens=4)
    stream = await sim.stream(engine, COMPLETIONS, BODY)
    assert all(set(event["choices"][0]) >= {"text"} for event in stream.events)


async def test_the_descriptor_has_vllm_0_32s_members_in_its_order(sim: Sim) -> None:
    producer = await sim.start()
    descriptor = await descriptor_of(sim, producer, BODY)
    assert list(descriptor) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    assert (descriptor["dcp_size"], descriptor["pp_size"]) == (1, 1)
    assert descriptor["remote_num_tokens"] == len(tokenize(PROMPT))
    assert descriptor["remote_blocks_expiry_time"] is None
    assert descriptor["transfer_mode"] == "pull"
    assert descriptor["remote_prefill_cached_tokens"] == 0
    again = await descriptor_of(sim, producer, BODY)
    # The second prefill finds the prompt's full blocks in the producer's prefix cache.
    assert again["remote_prefill_cached_tokens"] == len(tokenize(PROMPT)) // 16 * 16


@pytest.mark.parametrize(("device", "block_size"), [("cuda", 16), ("cpu", 128)])
async def test_the_block_size_defaults_to_the_devices(
    sim: Sim, device: str, block_size: int
) -> None:
    engine = await sim.start(device=device)
    async with sim.session.get(engine.url + "/sim/identity") as response:
        assert (await response.json())["block_size"] == block_size
    async with sim.session.get(engine.url + "/metrics") as response:
        assert f'vllm:cache_config_info{{block_size="{block_size}",' in await response.text()


async def test_usage_reports_cached_tokens_only_when_enabled_and_never_the_pulled_ones(
    sim: Sim,
) -> None:
    producer = await sim.start()
    consumer = await sim.start(enable_prompt_tokens_details=True)
    plain = await sim.start()
    _, answer = await sim.post(plain, COMPLETIONS, BODY)
    assert answer["usage"]["prompt_tokens_details"] is None
    descriptor = await descriptor_of(sim, producer, BODY)
    body = BODY | {"stream_options": {"include_usage": True}, "kv_transfer_params": descriptor}
    stream = await sim.stream(consumer, COMPLETIONS, body)
    assert stream.events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt_tokens = len(tokenize(PROMPT))
    assert await metric(
        sim,
        consumer,
        'vllm:prompt_tokens_by_source_total{model_name="narwhal-sim",engine="0",'
        'source="external_kv_transfer"}',
    ) == float(prompt_tokens - 1)
    assert await metric(
        sim,
        producer,
        'vllm:prompt_tokens_by_source_total{model_name="narwhal-sim",engine="0",'
        'source="local_compute"}',
    ) == float(prompt_tokens)


async def test_an_expired_lease_is_counted_by_the_producer(sim: Sim) -> None:
    producer = await sim.start(kv_lease_s=0.05)
    await descriptor_of(sim, producer, BODY)
    await sim.until(lambda: producer.held_block_count() == 0)
    series = 'vllm:nixl_num_kv_expired_reqs_total{model_name="narwhal-sim",engine="0"}'
    assert await metric(sim, producer, series) == 1.0


async def test_a_decode_waiting_for_a_seat_keeps_the_producers_blocks_alive(sim: Sim) -> None:
    # The lease (1.2 s) is shorter than the wait for the consumer's only seat (~2.4 s);
    # heartbeats every 0.2 s keep the blocks until the pull.
    producer = await sim.start(kv_lease_s=1.2)
    consumer = await sim.start(kv_lease_s=1.2, max_num_seqs=1, inter_token_s=0.1)
    busy = asyncio.create_task(sim.stream(consumer, COMPLETIONS, BODY))
    await sim.until(lambda: consumer.running_count() == 1)
    descriptor = await descriptor_of(sim, producer, BODY)
    stream = await sim.stream(consumer, COMPLETIONS, BODY | {"kv_transfer_params": descriptor})
    await busy
    assert stream.done and "error" not in stream.events[-1]
    assert producer.held_block_count() == 0


async def test_a_heartbeat_moves_the_expiry_to_two_thirds_of_a_lease_from_now() -> None:
    freed: list[list[int]] = []
    holds = HeldBlocks(1.2, freed.append)
    holds.hold("r", [1, 2], [b"a", b"b"])
    await asyncio.sleep(0.7)
    holds.renew("r")  # now kept 0.8 s from here, later than the 0.5 s left
    await asyncio.sleep(0.65)
    assert not freed
    await asyncio.sleep(0.5)
    assert freed == [[1, 2]]
    holds.renew("r")  # nothing held: nothing to do


def test_the_lease_defaults_to_vllms_thirty_seconds() -> None:
    from narwhal.sim.options import SimOptions

    assert SimOptions().kv_lease_s == 30.0
