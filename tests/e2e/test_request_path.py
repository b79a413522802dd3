"""The request path end to end: the official client through the router to simulated engines."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from narwhal.tools.sim.faults import Fault
from support.stack import (
    CHAT,
    COMPLETION,
    MODEL,
    StackFactory,
    direct_text,
    sse_payloads,
)

# The core of the request path: over the fast lane and over aiohttp alike.
pytestmark = pytest.mark.both_lanes


async def test_openai_client_gets_completions_streamed_and_not(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        client = stack.openai()
        whole = await client.completions.create(model=MODEL, prompt="The sea is", max_tokens=12)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 12
        pieces = []
        async for chunk in await client.completions.create(
            model=MODEL, prompt="The sea is", max_tokens=12, stream=True
        ):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
        assert "".join(pieces) == whole.choices[0].text
        body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 12}
        expected = await direct_text(stack.engine("p0").url, "/v1/completions", body)
        assert whole.choices[0].text == expected


async def test_openai_client_gets_chat_streamed_and_not(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        client = stack.openai()
        messages: Any = CHAT["messages"]
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
        assert whole.choices[0].message.role == "assistant"
        pieces = []
        usage = None
        async for chunk in await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(pieces) == whole.choices[0].message.content
        assert usage is not None and usage.completion_tokens == 9
        expected = await direct_text(stack.engine("d0").url, "/v1/chat/completions", CHAT)
        assert whole.choices[0].message.content == expected


async def test_handoff_crosses_engines_and_the_producer_frees_its_blocks(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        assert stack.engine("p0").held_block_count() == 0
        (line,) = await stack.journal()
        assert line["producer"] == "p0" and line["consumer"] == "d0"
        assert line["crossed"] is True and line["handoff"] == "crossed"


async def test_usage_chunk_reaches_only_clients_that_asked(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        body = {**COMPLETION, "stream": True}
        _, text = await stack.post("/v1/completions", body)
        assert all(p.get("choices") for p in sse_payloads(text))
        _, text = await stack.post(
            "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        usage = [p for p in sse_payloads(text) if not p.get("choices")]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 8
        assert text.endswith("data: [DONE]\n\n")


async def test_unknown_model_is_404(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        status, body = await stack.post("/v1/completions", {**COMPLETION, "model": "gpt-x"})
        assert status == 404
        assert "`gpt-x` does not exist" in body["error"]["message"]
        assert body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == "model"


async def test_n_above_one_is_400_before_any_engine_is_asked(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        status, body = await stack.post("/v1/completions", {**COMPLETION, "n": 2})
        assert status == 400 and "`n` > 1 is not supported" in body["error"]["message"]
        assert len(stack.engine("p0").received) == 0


async def test_a_body_over_the_limit_is_413(make_stack: StackFactory) -> None:
    async with make_stack(serving={"max_request_bytes": 1024}) as stack:
        status, body = await stack.post("/v1/completions", {**COMPLETION, "prompt": "x" * 2000})
        assert status == 413 and "serving.max_request_bytes" in body["error"]["message"]


async def test_an_engine_400_is_the_clients_and_keeps_its_message(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"max_model_len": 64}) as stack:
        status, body = await stack.post("/v1/completions", {**COMPLETION, "prompt": "word " * 100})
        assert status == 400
        assert "context length" in body["error"]["message"]


async def test_models_and_health(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        async with stack.http.get(stack.url + "/v1/models") as response:
            models = await response.json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        async with stack.http.get(stack.url + "/health") as response:
            assert response.status == 200


async def test_unknown_routes_answer_in_openai_shape(make_stack: StackFactory) -> None:
    async with make_stack() as stack, stack.http.get(stack.url + "/v1/nothing") as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == 404


async def test_journal_line_has_the_measurements(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        async with stack.http.post(
            stack.url + "/v1/completions",
            json={**COMPLETION, "stream": True},
            headers={"X-Request-Id": "client-abc"},
        ) as response:
            await response.read()
            router_id = response.headers["X-Request-Id"]
        (line,) = await stack.journal()
        assert line["request_id"] == router_id != "client-abc"
        assert line["client_request_id"] == "client-abc"
        assert line["endpoint"] == "/v1/completions" and line["attempts"] == 1
        assert 0 < line["ttft_s"] <= line["first_byte_s"] <= line["duration_s"]
        assert line["output_tokens"] == 8 and line["status"] == 200 and line["error"] is None
        assert "client-abc" not in line["backend_request_ids"]


async def test_backend_ids_are_fresh_and_shared_by_both_legs(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        async with stack.http.post(
            stack.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "mine"}
        ) as response:
            assert response.status == 200
        (prefill,) = stack.engine("p0").received
        (decode,) = stack.engine("d0").received
        assert prefill.request_id == decode.request_id != "mine"
        (line,) = await stack.journal()
        assert line["backend_request_ids"] == [prefill.request_id]


async def test_legs_follow_the_contract_and_drop_client_transfer_params(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        body = {
            **COMPLETION,
            "stream": True,
            "stream_options": {"include_usage": True},
            "min_tokens": 2,
            "kv_transfer_params": {"remote_host": "evil.example", "remote_engine_id": "x"},
        }
        status, _ = await stack.post("/v1/completions", body)
        assert status == 200
        (prefill,) = stack.engine("p0").received
        (decode,) = stack.engine("d0").received
        assert prefill.body["stream"] is False and prefill.body["max_tokens"] == 1
        assert "stream_options" not in prefill.body and "min_tokens" not in prefill.body
        assert prefill.body["kv_transfer_params"]["do_remote_decode"] is True
        assert prefill.body["kv_transfer_params"]["remote_host"] is None
        assert decode.body["stream"] is True and decode.body["max_tokens"] == 8
        descriptor = decode.body["kv_transfer_params"]
        assert descriptor["remote_engine_id"] == stack.engine("p0").engine_id
        assert descriptor["remote_host"] != "evil.example"


async def test_same_worker_sends_no_transfer_params_on_either_leg(
    make_stack: StackFactory,
) -> None:
    async with make_stack((("b0", "both"),)) as stack:
        body = {**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True}}
        status, answer = await stack.post("/v1/completions", body)
        assert status == 200
        prefill, decode = stack.engine("b0").received
        assert "kv_transfer_params" not in prefill.body
        assert "kv_transfer_params" not in decode.body
        assert answer["choices"][0]["text"] == await direct_text(
            stack.engine("b0").url, "/v1/completions", COMPLETION
        )
        (line,) = await stack.journal()
        assert line["crossed"] is False and line["handoff"] == "same_worker"


async def test_a_both_engine_still_prefers_a_distinct_consumer(make_stack: StackFactory) -> None:
    async with make_stack((("b0", "both"), ("b1", "both"))) as stack:
        await stack.post("/v1/completions", COMPLETION)
        (line,) = await stack.journal()
        assert line["producer"] != line["consumer"] and line["crossed"] is True


async def test_a_null_descriptor_decodes_by_recomputing(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        stack.engine("p0").set_fault(Fault.from_json({"phase": "prefill", "descriptor": "null"}))
        status, answer = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        (decode,) = stack.engine("d0").received
        assert "kv_transfer_params" not in decode.body
        assert answer["choices"][0]["text"] == await direct_text(
            stack.engine("d0").url, "/v1/completions", COMPLETION
        )
        (line,) = await stack.journal()
        assert line["handoff"] == "recomputed"


async def test_client_disconnect_aborts_the_engine_legs(make_stack: StackFactory) -> None:
    async with make_stack(sim={"inter_token_s": 0.05}) as stack:
        async with stack.http.post(
            stack.url + "/v1/completions", json={**COMPLETION, "max_tokens": 500, "stream": True}
        ) as response:
            await response.content.readline()
            assert stack.engine("d0").running_count() == 1
        for _ in range(100):
            if stack.engine("d0").running_count() == 0:
                break
            await asyncio.sleep(0.01)
        assert stack.engine("d0").running_count() == 0
        (line,) = await stack.journal()
        assert line["status"] == 499 and line["outcome"] == "client_closed"


async def test_client_disconnect_during_prefill_aborts_it(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        stack.engine("p0").set_fault(Fault.from_json({"phase": "prefill", "hang_s": 30}))
        timeout = aiohttp.ClientTimeout(total=0.3)
        with contextlib.suppress(TimeoutError):
            await stack.http.post(stack.url + "/v1/completions", json=COMPLETION, timeout=timeout)
        (line,) = await stack.journal()
        assert line["status"] == 499 and line["ttft_s"] is None
