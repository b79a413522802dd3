"""The engine's OpenAI surface, as the official client and a raw HTTP client see it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from openai.types.chat import ChatCompletionMessageParam

from narwhal.tools.sim.engine import SimEngine

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

PROMPT = "Tell me about the narwhals of the northern fjords, and why they sing at night."

# Chunk members as vLLM 0.32 serializes them (`model_dump_json(exclude_unset=True)`).
COMPLETION_CHUNK_KEYS = {"id", "object", "created", "model", "choices"}
COMPLETION_CHOICE_KEYS = [
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "prompt_token_ids",
    "token_ids",
]
CHAT_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "token_ids"]
CHAT_LAST_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]


def _client(engine: SimEngine) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)


async def test_openai_client_gets_a_completion(sim: Sim) -> None:
    engine = await sim.start()
    async with _client(engine) as client:
        completion = await client.completions.create(
            model="narwhal-sim", prompt=PROMPT, max_tokens=7
        )
    assert completion.object == "text_completion"
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text.startswith(" ")
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7


async def test_openai_client_streams_a_completion_with_usage(sim: Sim) -> None:
    engine = await sim.start()
    async with _client(engine) as client:
        plain = await client.completions.create(model="narwhal-sim", prompt=PROMPT, max_tokens=9)
        stream = await client.completions.create(
            model="narwhal-sim",
            prompt=PROMPT,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9


async def test_openai_client_gets_a_chat_completion(sim: Sim) -> None:
    engine = await sim.start()
    async with _client(engine) as client:
        chat = await client.chat.completions.create(
            model="narwhal-sim",
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": PROMPT},
            ],
            max_completion_tokens=5,
        )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5


async def test_openai_client_streams_a_chat_completion(sim: Sim) -> None:
    engine = await sim.start()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    async with _client(engine) as client:
        plain = await client.chat.completions.create(
            model="narwhal-sim",
            messages=messages,
            max_tokens=6,
        )
        stream = await client.chat.completions.create(
            model="narwhal-sim",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


async def test_openai_client_sees_400_for_n_above_one(sim: Sim) -> None:
    engine = await sim.start()
    async with _client(engine) as client:
        with pytest.raises(BadRequestError):
            await client.completions.create(model="narwhal-sim", prompt=PROMPT, max_tokens=3, n=2)


async def test_openai_client_sees_404_for_another_model(sim: Sim) -> None:
    engine = await sim.start()
    async with _client(engine) as client:
        with pytest.raises(NotFoundError):
            await client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=3)


async def test_completion_chunks_have_exactly_the_contract_keys(sim: Sim) -> None:
    engine = await sim.start()
    body = {"prompt": PROMPT, "max_tokens": 4, "stream_options": {"include_usage": True}}
    stream = await sim.stream(engine, "/v1/completions", body)
    assert stream.status == 200
    assert stream.done and stream.after_done == b""
    *chunks, usage = stream.events
    assert len(chunks) == 4
    for chunk in chunks:
        assert set(chunk) == COMPLETION_CHUNK_KEYS
        assert chunk["object"] == "text_completion"
        assert [list(choice) for choice in chunk["choices"]] == [COMPLETION_CHOICE_KEYS]
        assert chunk["choices"][0]["logprobs"] is None
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 3 + ["length"]
    assert set(usage) == COMPLETION_CHUNK_KEYS | {"usage", "system_fingerprint"}
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 17, "total_tokens": 21, "completion_tokens": 4}
    assert usage["system_fingerprint"] == engine.fingerprint


async def test_without_usage_the_finishing_chunk_carries_the_fingerprint(sim: Sim) -> None:
    engine = await sim.start()
    stream = await sim.stream(engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert [event.get("system_fingerprint") for event in stream.events] == [
        None,
        None,
        engine.fingerprint,
    ]
    assert engine.fingerprint.startswith("vllm-0.11.0-")


async def test_chat_chunks_start_with_the_role_delta(sim: Sim) -> None:
    engine = await sim.start()
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    stream = await sim.stream(engine, "/v1/chat/completions", body)
    assert stream.done
    role, *tokens = stream.events
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert set(role) == COMPLETION_CHUNK_KEYS | {"prompt_token_ids", "prompt_text"}
    for chunk in tokens:
        assert chunk["object"] == "chat.completion.chunk"
    assert [set(chunk) for chunk in tokens[:-1]] == [COMPLETION_CHUNK_KEYS] * 2
    assert set(tokens[-1]) == COMPLETION_CHUNK_KEYS | {"system_fingerprint"}
    choices = [chunk["choices"][0] for chunk in tokens]
    assert [list(choice) for choice in choices] == [CHAT_CHOICE_KEYS] * 2 + [CHAT_LAST_CHOICE_KEYS]
    assert [list(choice["delta"]) for choice in choices] == [["content"]] * 3


async def test_stream_without_include_usage_has_no_usage_chunk(sim: Sim) -> None:
    engine = await sim.start()
    stream = await sim.stream(engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert all(event["choices"] for event in stream.events)
    assert stream.done


async def test_request_id_header_becomes_the_response_id(sim: Sim) -> None:
    engine = await sim.start()
    headers = {"X-Request-Id": "abc123"}
    _, completion = await sim.post(
        engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers
    )
    chat = await sim.stream(
        engine,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers,
    )
    assert completion["id"] == "cmpl-abc123"
    assert {event["id"] for event in chat.events} == {"chatcmpl-abc123"}


async def test_stop_string_truncates_the_text_and_finishes_with_stop(sim: Sim) -> None:
    engine = await sim.start()
    path = "/v1/completions"
    _, free = await sim.post(engine, path, {"prompt": PROMPT, "max_tokens": 20})
    words = free["choices"][0]["text"].split(" ")
    stop = f"{words[5]} {words[6][:2]}"  # spans tokens 5 and 6, ends mid-word
    body = {"prompt": PROMPT, "max_tokens": 20, "stop": ["zzz", stop]}
    _, stopped = await sim.post(engine, path, body)
    stream = await sim.stream(engine, path, body)
    expected = free["choices"][0]["text"][: free["choices"][0]["text"].index(stop)]
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == stop
    assert stopped["usage"]["completion_tokens"] == 6
    assert stream.text == expected
    assert stream.events[-1]["choices"][0]["finish_reason"] == "stop"
    assert stream.events[-1]["choices"][0]["stop_reason"] == stop
    # One event per generated token, text held back for the stop string or not.
    assert len(stream.events) == 6


async def test_seed_and_temperature_determine_the_text(sim: Sim) -> None:
    engine = await sim.start()
    path = "/v1/completions"

    async def text(**sampling: float) -> str:
        _, body = await sim.post(engine, path, {"prompt": PROMPT, "max_tokens": 8, **sampling})
        result: str = body["choices"][0]["text"]
        return result

    assert await text(seed=1, temperature=0.7) == await text(seed=1, temperature=0.7)
    assert await text(seed=1, temperature=0.7) != await text(seed=2, temperature=0.7)
    assert await text(seed=1, temperature=0) == await text(seed=2, temperature=0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "word " * 65, "max_tokens": 4}, "input_tokens"),
        ({"max_tokens": 65}, "max_tokens"),
    ],
)
async def test_a_prompt_or_cap_beyond_the_context_is_a_400_naming_it(
    sim: Sim, fields: dict[str, Any], param: str
) -> None:
    engine = await sim.start(max_model_len=64)
    status, body = await sim.post(engine, "/v1/completions", {"prompt": PROMPT, **fields})
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "BadRequestError"
    assert (body["error"]["code"], body["error"]["param"]) == (400, param)
    assert f"(parameter={param}, value=" in body["error"]["message"]


async def test_a_cap_past_the_context_left_shrinks_to_fit_as_in_vllm(sim: Sim) -> None:
    engine = await sim.start(max_model_len=64)
    status, body = await sim.post(engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 64


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"max_tokens": "5"},
        {"temperature": -1},
        {"stop": [1]},
        {"seed": 1.5},
        {"best_of": 3},
        {"stream_options": {"include_usage": True}},
        {"prompt": {"text": "x"}},
        {"prompt": ""},
        {"min_tokens": 9, "max_tokens": 2},
    ],
)
async def test_bad_fields_are_a_400(sim: Sim, fields: dict[str, object]) -> None:
    engine = await sim.start()
    status, body = await sim.post(
        engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3} | fields
    )
    assert status == 400
    assert body["error"]["code"] == 400


async def test_empty_stream_options_without_streaming_are_accepted_as_in_vllm(sim: Sim) -> None:
    engine = await sim.start()
    body = {"prompt": PROMPT, "max_tokens": 3, "stream_options": {}}
    status, _ = await sim.post(engine, "/v1/completions", body)
    assert status == 200


async def test_chat_prefers_max_completion_tokens(sim: Sim) -> None:
    engine = await sim.start()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    _, chat = await sim.post(engine, "/v1/chat/completions", body | {"max_completion_tokens": 2})
    assert chat["usage"]["completion_tokens"] == 2


async def test_info_routes_answer_like_vllm(sim: Sim) -> None:
    engine = await sim.start(model="tiny", max_model_len=1024, engine_id="fixed-id")
    assert await sim.get(engine, "/health") == (200, b"")
    models = orjson.loads((await sim.get(engine, "/v1/models"))[1])
    version = orjson.loads((await sim.get(engine, "/version"))[1])
    identity = orjson.loads((await sim.get(engine, "/sim/identity"))[1])
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 1024)]
    assert version == {"version": "0.11.0"}
    assert identity == {
        "engine_version": "0.11.0",
        "model": "tiny",
        "lora_adapters": {},
        "runtime_lora_updating": False,
        "connector": "NixlConnector",
        "block_size": 16,
        "tp_size": 1,
        "engine_id": "fixed-id",
    }


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing")


async def test_metrics_show_running_and_waiting_requests(sim: Sim) -> None:
    engine = await sim.start(max_num_seqs=1, inter_token_s=0.01, num_kv_blocks=64)
    body = {"prompt": PROMPT, "max_tokens": 30}
    requests = [asyncio.create_task(sim.post(engine, "/v1/completions", body)) for _ in range(3)]
    await sim.until(lambda: engine.waiting_count() == 2)
    text = (await sim.get(engine, "/metrics"))[1].decode()
    assert _metric(text, "vllm:num_requests_running") == 1
    assert _metric(text, "vllm:num_requests_waiting") == 2
    assert 0 < _metric(text, "vllm:kv_cache_usage_perc") <= 1
    assert _metric(text, "process_start_time_seconds") > 1e9
    results = await asyncio.gather(*requests)
    assert [status for status, _ in results] == [200, 200, 200]
    assert engine.running_count() == engine.waiting_count() == 0
    # vLLM's queue time histogram: every request counted, two of them after a wait.
    text = (await sim.get(engine, "/metrics"))[1].decode()
    assert _metric(text, "vllm:request_queue_time_seconds_count") == 3
    assert _metric(text, "vllm:request_queue_time_seconds_sum") > 0


async def test_kv_block_budget_makes_requests_wait(sim: Sim) -> None:
    # Each request needs ceil((prompt + 40) / 16) = 4 blocks: only one fits in 6.
    engine = await sim.start(num_kv_blocks=6, inter_token_s=0.005)
    body = {"prompt": PROMPT, "max_tokens": 40}
    requests = [asyncio.create_task(sim.post(engine, "/v1/completions", body)) for _ in range(2)]
    await sim.until(lambda: engine.running_count() + engine.waiting_count() == 2)
    assert (engine.running_count(), engine.waiting_count()) == (1, 1)
    await asyncio.gather(*requests)


async def test_closing_the_connection_aborts_the_request(sim: Sim) -> None:
    engine = await sim.start(inter_token_s=0.01)
    body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
    async with sim.session.post(engine.url + "/v1/completions", json=body) as response:
        await response.content.readuntil(b"\n\n")
        assert engine.running_count() == 1
    await sim.until(lambda: engine.running_count() == 0)


async def test_closing_a_waiting_request_leaves_the_queue(sim: Sim) -> None:
    engine = await sim.start(max_num_seqs=1, inter_token_s=0.01)
    path = "/v1/completions"
    running = asyncio.create_task(sim.post(engine, path, {"prompt": PROMPT, "max_tokens": 20}))
    waiting = asyncio.create_task(sim.post(engine, path, {"prompt": PROMPT, "max_tokens": 20}))
    await sim.until(lambda: engine.waiting_count() == 1)
    waiting.cancel()
    await sim.until(lambda: engine.waiting_count() == 0)
    status, _ = await running
    assert status == 200


async def test_prefix_cache_skips_prefill_compute(sim: Sim) -> None:
    engine = await sim.start(prefill_s_per_token=0.002)
    body = {"prompt": PROMPT * 4, "max_tokens": 1}  # ~80 tokens: ~0.16 s to prefill
    loop = asyncio.get_running_loop()
    started = loop.time()
    await sim.post(engine, "/v1/completions", body)
    cold = loop.time() - started
    started = loop.time()
    await sim.post(engine, "/v1/completions", body)
    warm = loop.time() - started
    assert cold > 0.12
    assert warm < cold / 3


async def test_prefix_cache_hits_are_counted_as_vllm_counts_them(sim: Sim) -> None:
    engine = await sim.start(enable_prompt_tokens_details=True)
    long_prompt = " ".join(f"word{i}" for i in range(100))
    body = {"prompt": long_prompt, "max_tokens": 2}
    cached = []
    for _ in range(2):
        status, answer = await sim.post(engine, "/v1/completions", body)
        assert status == 200
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    text = (await sim.get(engine, "/metrics"))[1].decode()
    queries = _metric(text, "vllm:prefix_cache_queries_total")
    hits = _metric(text, "vllm:prefix_cache_hits_total")
    prompt_tokens = answer["usage"]["prompt_tokens"]
    # Both requests queried every prompt token; the second found its whole blocks cached.
    assert queries == 2 * prompt_tokens
    assert cached[0] == 0
    assert cached[1] == prompt_tokens // 16 * 16
    assert hits == cached[1]
    assert engine.cached_prefix_tokens([1, 2, 3]) == 0
