"""The public Python API: `EngineClient.prefill()` hands a `PrefillResult` to `decode()`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
import pytest

from narwhal.engines.client import EngineClient, LegBounds
from narwhal.engines.connector import Delivery, PrefillResult
from narwhal.engines.decode_stream import stream_payloads
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.fleet import SimFleet
from support.stack import COMPLETION, FAST, MODEL, direct_text

ROUTE = "/v1/completions"


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet([dataclasses.replace(FAST, name=n) for n in ("p0", "d0")]) as engines:
        yield engines


async def test_prefill_then_decode_yields_what_one_engine_alone_yields(fleet: SimFleet) -> None:
    producer, consumer = fleet.engines
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        assert isinstance(result, PrefillResult)
        assert result.producer_url == producer.url and result.endpoint == ROUTE
        assert result.request_id
        text = ""
        async for event in client.decode(consumer.url, ROUTE, COMPLETION, result):
            assert isinstance(event, dict)
            for choice in event.get("choices", []):
                text += choice["text"]
    assert text == await direct_text(producer.url, ROUTE, COMPLETION)
    assert producer.held_block_count() == 0
    assert [r.request_id for r in consumer.received] == [result.request_id]


async def test_parameters_are_a_detached_copy(fleet: SimFleet) -> None:
    async with EngineClient() as client:
        result = await client.prefill(fleet.engines[0].url, ROUTE, COMPLETION)
    copy = result.parameters()
    assert copy["remote_engine_id"] == fleet.engines[0].engine_id
    copy["remote_engine_id"] = "changed"
    copy["remote_block_ids"].append(999)
    again = result.parameters()
    assert again["remote_engine_id"] == fleet.engines[0].engine_id
    assert 999 not in again["remote_block_ids"]


async def test_a_bad_descriptor_raises_before_any_decode_request(fleet: SimFleet) -> None:
    producer, consumer = fleet.engines
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        params = result.parameters()
        params["remote_block_ids"] = [1, "two"]
        tampered = dataclasses.replace(result, descriptor=orjson.dumps(params))
        with pytest.raises(NarwhalError) as info:
            async for _ in client.decode(consumer.url, ROUTE, COMPLETION, tampered):
                pass
    assert info.value.status == 502
    assert "remote_block_ids" in info.value.message
    assert len(consumer.received) == 0


async def test_decode_failures_carry_the_status_the_router_would_answer(
    fleet: SimFleet,
) -> None:
    producer, consumer = fleet.engines
    consumer.set_fault(Fault.from_json({"phase": "decode", "done_before_token": True}))
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            async for _ in client.decode(
                consumer.url, ROUTE, {**COMPLETION, "stream": True}, result
            ):
                pass
    assert info.value.status == 502
    assert info.value.message == "stream ended with [DONE] before any token arrived"


async def test_a_whole_decode_answers_once_what_one_engine_alone_answers(
    fleet: SimFleet,
) -> None:
    producer, consumer = fleet.engines
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        descriptor = await client.handoff_descriptor(consumer.url, ROUTE, result)
        answer = await client.send_whole(consumer.url, ROUTE, COMPLETION, result, descriptor)
        assert client.open_legs == 0
    sent = consumer.received[-1].body
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["kv_transfer_params"]["remote_engine_id"] == producer.engine_id
    body = orjson.loads(answer.body)
    assert body["choices"][0]["text"] == await direct_text(producer.url, ROUTE, COMPLETION)
    assert body["id"] == f"cmpl-{result.request_id}"
    usage = body["usage"]
    assert (answer.prompt_tokens, answer.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert producer.held_block_count() == 0


async def test_a_whole_decode_past_its_timeout_is_a_transient_504_and_closes_the_leg(
    fleet: SimFleet,
) -> None:
    producer, consumer = fleet.engines
    consumer.set_fault(Fault.from_json({"phase": "decode", "hang_s": 5.0}))
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            await client.send_whole(consumer.url, ROUTE, COMPLETION, result, None, timeout_s=0.2)
        assert client.open_legs == 0
    assert info.value.status == 504 and info.value.transient
    assert info.value.cause.value == "first_token_timeout"
    assert "engine.whole_answer_timeout_s" in info.value.message


@pytest.mark.parametrize(("status", "routed"), [(400, 400), (503, 502), (504, 504)])
async def test_a_whole_decodes_error_answer_keeps_its_status(
    fleet: SimFleet, status: int, routed: int
) -> None:
    producer, consumer = fleet.engines
    consumer.set_fault(Fault.from_json({"phase": "decode", "status": status}))
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            await client.send_whole(consumer.url, ROUTE, COMPLETION, result, None)
    assert info.value.status == routed
    assert info.value.transient is (status != 400)


# Leg bounds passed per call (a model's own), else the client's --------------------------

# A call's own bounds, short; the client's own are far past any fault below.
SHORT = LegBounds(prefill_timeout_s=0.3, first_token_timeout_s=0.3, decode_read_timeout_s=0.3)
STREAM = {**COMPLETION, "stream": True}


def long_client() -> EngineClient:
    return EngineClient(
        prefill_timeout_s=60.0, first_token_timeout_s=60.0, decode_read_timeout_s=60.0
    )


async def test_a_calls_own_first_token_bound_holds_and_is_the_one_its_error_names(
    fleet: SimFleet,
) -> None:
    producer, consumer = fleet.engines
    consumer.set_fault(Fault.from_json({"phase": "decode", "first_token_delay_s": 1.5}))
    async with long_client() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            await client.open_decode(consumer.url, ROUTE, STREAM, result, bounds=SHORT)
        assert info.value.cause is Cause.FIRST_TOKEN_TIMEOUT
        assert info.value.message.endswith("within the first-token timeout (0.3 s)")
        assert client.open_legs == 0
        # Without bounds of its own, a call takes the client's: the same delay passes.
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        async with await client.open_decode(consumer.url, ROUTE, STREAM, result) as stream:
            async for _ in stream_payloads(stream):
                pass


async def test_a_calls_own_prefill_bound_holds_and_is_the_one_its_error_names(
    fleet: SimFleet,
) -> None:
    producer, _ = fleet.engines
    producer.set_fault(Fault.from_json({"phase": "prefill", "hang_s": 1.5, "times": 1}))
    async with long_client() as client:
        with pytest.raises(NarwhalError) as info:
            await client.prefill(producer.url, ROUTE, COMPLETION, bounds=SHORT)
        assert client.open_legs == 0
    assert info.value.cause is Cause.PREFILL_TIMEOUT
    assert info.value.message.endswith("did not answer within 0.3 s")


async def test_a_calls_own_read_bound_goes_with_its_stream(fleet: SimFleet) -> None:
    producer, consumer = fleet.engines
    fault = {"phase": "decode", "silence_after": 1, "silence_s": 1.5}
    consumer.set_fault(Fault.from_json(fault))
    bounds = dataclasses.replace(SHORT, first_token_timeout_s=60.0)
    async with long_client() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            stream = await client.open_decode(consumer.url, ROUTE, STREAM, result, bounds=bounds)
            async with stream:
                async for _ in stream_payloads(stream):
                    pass
    assert info.value.cause is Cause.SILENCE
    assert info.value.message.endswith("sent nothing for 0.3 s")


# Off the request path: GETs of an engine's /metrics and /v1/models --------------------


async def test_fetch_reads_an_engines_metrics_and_models(fleet: SimFleet) -> None:
    engine = fleet.engines[0]
    async with EngineClient() as client:
        models = await client.fetch(engine.url + "/v1/models", 5.0)
        assert models is not None
        assert [card["id"] for card in orjson.loads(models)["data"]] == [MODEL]
        metrics = await client.fetch(engine.url + "/metrics", 5.0)
        assert metrics is not None and b"vllm:num_requests_running" in metrics


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def listening(handle: Handler) -> AsyncIterator[str]:
    """A loopback server answering by hand; yields its base URL."""
    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()


async def test_fetch_sends_one_get_per_read_on_one_kept_connection() -> None:
    heads: list[bytes] = []
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbody")
                await writer.drain()
        writer.close()

    async with listening(handle) as url, EngineClient() as client:
        assert await client.fetch(url + "/metrics", 1.0) == b"body"
        assert await client.fetch(url + "/v1/models?x=1", 1.0) == b"body"
    host = url.removeprefix("http://")
    assert connections == [1]
    assert heads == [
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
        f"GET /v1/models?x=1 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
    ]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno",
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ncut",
        b"not http at all\r\n\r\n",
        None,
    ],
    ids=["404", "cut", "not-http", "silent"],
)
async def test_fetch_is_none_for_anything_but_a_whole_200_in_time(answer: bytes | None) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await asyncio.sleep(5)
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    async with listening(handle) as url, EngineClient() as client:
        started = asyncio.get_running_loop().time()
        assert await client.fetch(url + "/metrics", 0.3) is None
        assert asyncio.get_running_loop().time() - started < 3.0


async def test_fetch_of_an_engine_that_is_down_is_none() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    async with EngineClient() as client:
        assert await client.fetch(f"http://127.0.0.1:{port}/metrics", 1.0) is None


# A decode leg the consumer refuses ----------------------------------------------------

RESPONSES = {"model": MODEL, "input": "The sea is deep and", "max_output_tokens": 8}


@pytest.mark.parametrize("leg", ["stream", "whole", "responses"])
async def test_a_refused_decode_keeps_its_status_and_says_its_descriptor_was_refused(
    fleet: SimFleet, leg: str
) -> None:
    producer, consumer = fleet.engines
    consumer.set_fault(Fault.from_json({"phase": "decode", "status": 400}))
    delivery = Delivery()
    async with EngineClient() as client:
        result = await client.prefill(producer.url, ROUTE, COMPLETION)
        with pytest.raises(NarwhalError) as info:
            if leg == "stream":
                await client.send_decode(
                    consumer.url, ROUTE, STREAM, result, None, delivery=delivery
                )
            elif leg == "whole":
                await client.send_whole(
                    consumer.url, ROUTE, COMPLETION, result, None, delivery=delivery
                )
            else:
                await client.send_responses(
                    consumer.url, RESPONSES, result, None, rewrite={}, delivery=delivery
                )
        assert client.open_legs == 0
    assert info.value.status == 400 and not info.value.transient
    assert delivery.written and delivery.refused and not delivery.delivered
