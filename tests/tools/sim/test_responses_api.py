"""`POST /v1/responses` on a simulated engine, as vLLM 0.32 serves it: the response object,
the event stream, the prefill and decode legs, and what the engine refuses.

Shapes are checked against real vLLM 0.32 answers recorded in tests/data/vllm/.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.model import chat_prompt, tokenize

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
CAPTURES = Path(__file__).parents[2] / "data" / "vllm"
PROMPT = "Where do the narwhals go when the fjord freezes over in the long night?"
BODY: dict[str, Any] = {"input": PROMPT, "max_output_tokens": 12, "temperature": 0}
PREFILL_PARAMS = prefill_request_params()
EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
EVENT_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@dataclass
class EventStream:
    """A read Responses stream: each event and when it came, whether the body was cut."""

    status: int
    content_type: str
    headers_at: float = 0.0
    raw: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    comments: list[bytes] = field(default_factory=list)
    broken: bool = False
    error: Any = None

    @property
    def types(self) -> list[str]:
        return [event["type"] for event in self.events]

    @property
    def deltas(self) -> list[str]:
        return [e["delta"] for e in self.events if e["type"] == "response.output_text.delta"]

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def completed(self) -> dict[str, Any]:
        assert self.types[-1] == "response.completed", self.types
        response: dict[str, Any] = self.events[-1]["response"]
        return response


def parse_event(chunk: bytes) -> dict[str, Any]:
    """One SSE event: an `event:` line naming the data's `type`, then a `data:` line."""
    head, data = chunk.split(b"\n", 1)
    assert head.startswith(b"event: ") and data.startswith(b"data: "), chunk
    event: dict[str, Any] = orjson.loads(data.removeprefix(b"data: "))
    assert event["type"] == head.removeprefix(b"event: ").decode()
    return event


async def read_stream(
    sim: Sim, engine: SimEngine, body: dict[str, Any], headers: dict[str, str] | None = None
) -> EventStream:
    """A streamed Responses call read to its end (or to where the body broke off)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    url = engine.url + RESPONSES
    async with sim.session.post(url, json=body | {"stream": True}, headers=headers) as response:
        stream = EventStream(response.status, response.headers.get("Content-Type", ""))
        stream.headers_at = loop.time() - started
        if response.status != 200:
            stream.error = orjson.loads(await response.read())
            return stream
        try:
            while not response.content.at_eof():
                chunk = (await response.content.readuntil(b"\n\n")).strip(b"\n")
                if not chunk:
                    continue
                stream.raw += chunk + b"\n\n"
                if chunk.startswith(b":"):
                    stream.comments.append(chunk)
                    continue
                stream.events.append(parse_event(chunk))
                stream.times.append(loop.time() - started)
        except aiohttp.ClientPayloadError:
            stream.broken = True
    return stream


def client(engine: SimEngine) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=30)


def capture(name: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads((CAPTURES / f"{name}.json").read_text())
    return value


def captured_events(name: str) -> list[dict[str, Any]]:
    """A recorded stream's events with their members in the order vLLM sent them."""
    raw: str = capture(name)["raw"]
    return [parse_event(chunk.encode()) for chunk in raw.split("\n\n") if chunk]


def text_of(response: dict[str, Any]) -> str:
    """The text of a response's message items."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


# -- through the official client ------------------------------------------------------------


async def test_openai_client_creates_a_response(sim: Sim) -> None:
    engine = await sim.start()
    async with client(engine) as openai:
        response = await openai.responses.create(
            model="narwhal-sim",
            input=PROMPT,
            max_output_tokens=7,
            extra_body={"request_id": "resp_client-made"},
        )
    assert response.id == "resp_client-made"
    assert response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text.startswith(" ")
    assert response.usage is not None
    assert response.usage.output_tokens == 7
    assert response.usage.total_tokens == response.usage.input_tokens + 7


async def test_openai_client_streams_a_response_with_the_text_of_a_whole_one(sim: Sim) -> None:
    engine = await sim.start(eos_probability=0.05)
    async with client(engine) as openai:
        whole = await openai.responses.create(
            model="narwhal-sim", input=PROMPT, max_output_tokens=40, temperature=0
        )
        async with openai.responses.stream(
            model="narwhal-sim", input=PROMPT, max_output_tokens=40, temperature=0
        ) as stream:
            types = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert final.output_text == whole.output_text != ""
    assert final.status == whole.status
    assert types[:4] == EVENT_ORDER
    assert types[-4:] == EVENT_END
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_openai_client_sees_the_refusals_as_their_errors(sim: Sim) -> None:
    engine = await sim.start()
    async with client(engine) as openai:
        with pytest.raises(NotFoundError):
            await openai.responses.create(
                model="narwhal-sim", input="hi", previous_response_id="resp_earlier"
            )
        with pytest.raises(BadRequestError):
            await openai.responses.create(model="narwhal-sim", input="hi", max_output_tokens=0)
        with pytest.raises(NotFoundError):
            await openai.responses.create(model="no-such-model", input="hi")


# -- the answer's shapes ----------------------------------------------------------------------


async def test_a_stream_is_vllm_s_event_sequence_counted_from_zero(sim: Sim) -> None:
    engine = await sim.start()
    stream = await read_stream(sim, engine, BODY | {"request_id": "resp_seq"})
    assert (stream.status, stream.content_type) == (200, "text/event-stream; charset=utf-8")
    assert not stream.broken
    assert b"[DONE]" not in stream.raw
    assert stream.types == EVENT_ORDER + ["response.output_text.delta"] * 12 + EVENT_END
    assert [event["sequence_number"] for event in stream.events] == list(range(20))
    created, in_progress = stream.events[0]["response"], stream.events[1]["response"]
    assert created == in_progress
    assert (created["id"], created["status"], created["output"]) == ("resp_seq", "in_progress", [])
    assert created["usage"] is None
    item = stream.events[2]["item"]
    assert (item["status"], item["content"], item["role"]) == ("in_progress", [], "assistant")
    assert re.fullmatch(r"msg_[0-9a-f]{16}", item["id"])
    assert {event.get("item_id", item["id"]) for event in stream.events[3:-1]} == {item["id"]}
    done = stream.events[-2]["item"]
    assert done["content"][0]["text"] == stream.text == stream.events[-4]["text"]
    final = stream.completed
    assert final["output"] == [done]
    assert (final["status"], final["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert final["usage"]["output_tokens"] == 12
    assert final["kv_transfer_params"] is None


async def test_event_members_are_in_vllm_s_order(sim: Sim) -> None:
    engine = await sim.start()
    stream = await read_stream(sim, engine, BODY)
    # The recording has a reasoning item first (a reasoning parser was on); the message's
    # events come after its, so the last event of each type is the message's.
    recorded = {event["type"]: event for event in captured_events("responses_stream")}
    for event in stream.events:
        expected = recorded[event["type"]]
        assert list(event) == list(expected), event["type"]
        for member in ("response", "item", "part"):
            if member in event:
                assert list(event[member]) == list(expected[member]), (event["type"], member)
    final, expected_final = stream.completed, recorded["response.completed"]["response"]
    assert list(final["usage"]) == list(expected_final["usage"])
    assert list(final["output"][0]) == list(expected_final["output"][1])
    assert list(final["output"][0]["content"][0]) == list(expected_final["output"][1]["content"][0])


async def test_a_whole_response_has_vllm_s_members(sim: Sim) -> None:
    engine = await sim.start()
    status, answer = await sim.post(engine, RESPONSES, BODY | {"max_output_tokens": 64})
    recorded = capture("responses_decode")["json"]
    assert status == 200
    assert list(answer) == list(capture_order(recorded))
    assert answer["object"] == "response"
    assert (answer["status"], answer["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert answer["tool_choice"] == "none" and answer["tools"] == []
    assert answer["max_output_tokens"] == 64
    usage = answer["usage"]
    assert set(usage) == set(recorded["usage"])
    assert set(usage["input_tokens_details"]) == set(recorded["usage"]["input_tokens_details"])
    assert set(usage["output_tokens_details"]) == set(recorded["usage"]["output_tokens_details"])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    (message,) = answer["output"]
    assert set(message) == set(recorded["output"][1])
    assert (message["type"], message["role"], message["status"]) == (
        "message",
        "assistant",
        "completed",
    )
    assert set(message["content"][0]) == set(recorded["output"][1]["content"][0])


def capture_order(recorded: dict[str, Any]) -> list[str]:
    """A recorded response's members in vLLM's order (the recording sorted them): its
    stream's `response.completed` keeps the order vLLM dumps them in."""
    completed = captured_events("responses_stream")[-1]["response"]
    assert set(completed) == set(recorded)
    return list(completed)


async def test_the_body_s_request_id_is_the_response_s_id_and_the_header_is_not(
    sim: Sim,
) -> None:
    engine = await sim.start()
    headers = {"X-Request-Id": "from-the-header"}
    _, named = await sim.post(engine, RESPONSES, BODY | {"request_id": "resp_mine"}, headers)
    _, unnamed = await sim.post(engine, RESPONSES, BODY, headers)
    stream = await read_stream(sim, engine, BODY | {"request_id": "resp_streamed"}, headers)
    assert named["id"] == "resp_mine"
    assert re.fullmatch(r"resp_[0-9a-f]{16}", unnamed["id"])
    assert stream.events[0]["response"]["id"] == stream.completed["id"] == "resp_streamed"


async def test_a_generation_that_stops_by_itself_is_completed(sim: Sim) -> None:
    engine = await sim.start(eos_probability=1.0)
    _, answer = await sim.post(engine, RESPONSES, BODY)
    stream = await read_stream(sim, engine, BODY)
    assert (answer["status"], answer["incomplete_details"]) == ("completed", None)
    # The end of sequence releases no text: the whole answer keeps an empty message, a
    # stream adds none.
    assert answer["output"][0]["content"] == []
    assert stream.types == ["response.created", "response.in_progress", "response.completed"]
    assert stream.completed["output"] == []
    assert stream.completed["status"] == "completed"


async def test_tokens_that_release_no_text_send_no_delta(sim: Sim) -> None:
    engine = await sim.start(empty_token_probability=0.5)
    stream = await read_stream(sim, engine, BODY | {"max_output_tokens": 40})
    assert "" not in stream.deltas
    assert 0 < len(stream.deltas) < 40
    assert stream.completed["usage"]["output_tokens"] == 40


# -- the prompt: the chat route's, for the same conversation -----------------------------------


CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Hello"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello! How can I help you today?"}],
    },
    {"role": "user", "content": [{"type": "input_text", "text": "What is a narwhal?"}]},
]
CHAT_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer like a whale."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "What is a narwhal?"},
]


@pytest.mark.parametrize(
    ("responses_body", "messages"),
    [
        ({"input": PROMPT}, [{"role": "user", "content": PROMPT}]),
        (
            {"input": PROMPT, "instructions": "Answer like a whale."},
            [
                {"role": "system", "content": "Answer like a whale."},
                {"role": "user", "content": PROMPT},
            ],
        ),
        ({"input": CONVERSATION, "instructions": "Answer like a whale."}, CHAT_MESSAGES),
    ],
    ids=["string", "instructions", "items"],
)
async def test_a_response_says_what_the_chat_route_says(
    sim: Sim, responses_body: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    engine = await sim.start()
    _, chat = await sim.post(
        engine, CHAT, {"messages": messages, "max_tokens": 15, "temperature": 0}
    )
    _, answer = await sim.post(
        engine, RESPONSES, responses_body | {"max_output_tokens": 15, "temperature": 0}
    )
    assert text_of(answer) == chat["choices"][0]["message"]["content"] != ""
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert answer["usage"]["input_tokens"] == len(tokenize(chat_prompt(messages)))


async def test_an_assistant_s_reasoning_and_text_make_one_turn(sim: Sim) -> None:
    engine = await sim.start()
    reasoning = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Hm."}],
    }
    items = [*CONVERSATION[:1], reasoning, *CONVERSATION[1:]]
    _, with_reasoning = await sim.post(engine, RESPONSES, BODY | {"input": items})
    _, without = await sim.post(engine, RESPONSES, BODY | {"input": CONVERSATION})
    assert with_reasoning["usage"]["input_tokens"] == without["usage"]["input_tokens"]
    assert text_of(with_reasoning) == text_of(without)


# -- prefill and decode --------------------------------------------------------------------


async def _prefill(sim: Sim, producer: SimEngine, body: dict[str, Any]) -> dict[str, Any]:
    """The first leg, as a router sends it; returns the producer's answer."""
    leg = body | {"max_output_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    status, answer = await sim.post(producer, RESPONSES, leg)
    assert status == 200, answer
    result: dict[str, Any] = answer
    return result


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize(
    "body",
    [BODY, BODY | {"input": CONVERSATION, "instructions": "Answer like a whale."}],
    ids=["string", "items"],
)
async def test_prefill_then_decode_says_what_one_engine_says(
    sim: Sim, body: dict[str, Any], stream: bool
) -> None:
    producer, consumer = await sim.start(name="p"), await sim.start(name="d")
    _, alone = await sim.post(producer, RESPONSES, body)
    prefill = await _prefill(sim, producer, body | {"request_id": "resp_pd"})
    descriptor = prefill["kv_transfer_params"]
    assert prefill["id"] == "resp_pd"
    assert prefill["status"] == "incomplete"
    assert prefill["usage"]["output_tokens"] == 1
    assert text_of(alone).startswith(text_of(prefill))
    assert descriptor["do_remote_prefill"] is True
    assert descriptor["remote_engine_id"] == producer.engine_id
    assert descriptor["remote_request_id"] == "resp_pd_0"
    assert descriptor["remote_num_tokens"] == prefill["usage"]["input_tokens"]
    assert producer.held_block_count() > 0

    decode = body | {"request_id": "resp_pd", "kv_transfer_params": descriptor}
    if stream:
        read = await read_stream(sim, consumer, decode)
        text, final = read.text, read.completed
    else:
        _, final = await sim.post(consumer, RESPONSES, decode)
        text = text_of(final)
    assert text == text_of(alone) != ""
    assert final["id"] == "resp_pd"
    assert final["kv_transfer_params"] is None
    assert final["usage"]["input_tokens"] == alone["usage"]["input_tokens"]
    # vLLM reports the producer's own prefix-cache hits, not the pulled tokens.
    cached = final["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == descriptor["remote_prefill_cached_tokens"] > 0  # `alone` warmed it
    assert producer.held_block_count() == 0
    assert [(h.ok, h.remote_request_id) for h in consumer.handoffs] == [(True, "resp_pd_0")]


async def test_a_streamed_prefill_carries_its_descriptor_in_response_completed(sim: Sim) -> None:
    producer, consumer = await sim.start(name="p"), await sim.start(name="d")
    leg = BODY | {"max_output_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    stream = await read_stream(sim, producer, leg)
    descriptor = stream.completed["kv_transfer_params"]
    assert descriptor["remote_engine_id"] == producer.engine_id
    _, decoded = await sim.post(consumer, RESPONSES, BODY | {"kv_transfer_params": descriptor})
    _, alone = await sim.post(consumer, RESPONSES, BODY)
    assert text_of(decoded) == text_of(alone)
    assert producer.held_block_count() == 0


async def test_a_turned_away_decode_releases_the_producer_s_blocks(sim: Sim) -> None:
    producer, consumer = await sim.start(name="p"), await sim.start(name="d")
    descriptor = (await _prefill(sim, producer, BODY))["kv_transfer_params"]
    assert producer.held_block_count() > 0
    decode = BODY | {"kv_transfer_params": descriptor, "previous_response_id": "resp_gone"}
    status, _ = await sim.post(consumer, RESPONSES, decode)
    assert status == 404
    await sim.until(lambda: producer.held_block_count() == 0)


async def test_requests_count_in_the_engine_s_metrics(sim: Sim) -> None:
    engine = await sim.start()
    await sim.post(engine, RESPONSES, BODY)
    await read_stream(sim, engine, BODY)
    _, metrics = await sim.get(engine, "/metrics")
    generated = re.search(rb"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert generated is not None and float(generated.group(1)) == 24.0
    assert (engine.running_count(), engine.waiting_count()) == (0, 0)


async def test_priority_orders_responses_as_other_requests(sim: Sim) -> None:
    engine = await sim.start(scheduling_policy="priority", max_num_seqs=1, faults_enabled=True)
    hold = {"x-sim-fault": orjson.dumps({"first_token_delay_s": 60}).decode()}
    holder = asyncio.create_task(read_stream(sim, engine, BODY, hold))
    await sim.until(lambda: engine.running_count() == 1)
    served: list[int] = []

    async def one(priority: int) -> None:
        status, _ = await sim.post(engine, RESPONSES, BODY | {"priority": priority})
        assert status == 200
        served.append(priority)

    tasks = []
    for priority in (3, -3, 0):
        tasks.append(asyncio.create_task(one(priority)))
        await sim.until(lambda: engine.waiting_count() == len(tasks))
    holder.cancel()
    async with asyncio.timeout(30):
        await asyncio.gather(*tasks)
    assert served == [-3, 0, 3]
    await sim.post(engine, RESPONSES, BODY | {"priority": 1}, {"X-Vllm-Priority": "-2"})
    assert engine.received[-1].priority == -2


# -- what the engine refuses -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "responses_error_previous_response_id",
        "responses_error_background",
        "responses_error_input",
        "responses_error_max_output_tokens",
    ],
)
async def test_refusals_are_vllm_s(sim: Sim, name: str) -> None:
    recorded = capture(name)
    engine = await sim.start(model="narwhal-tiny")
    status, answer = await sim.post(engine, RESPONSES, recorded["request"]["body"])
    assert status == recorded["status"]
    assert answer == recorded["json"]


@pytest.mark.parametrize(
    ("change", "status", "param", "message"),
    [
        ({"input": None}, 400, "body.input", "2 validation errors:\n  {'type': 'string_type'"),
        ({"stream": "maybe"}, 400, "body.stream", "1 validation error:\n  {'type': 'bool_parsing'"),
        ({"max_output_tokens": 1.5}, 400, "body.max_output_tokens", "1 validation error:"),
        ({"max_output_tokens": 9000}, 400, "max_output_tokens", "max_output_tokens=9000 cannot"),
        ({"model": "other"}, 404, "model", "The model `other` does not exist."),
        ({"background": True, "store": False}, 400, "background", "background can only be"),
        ({"prompt": {"id": "p"}}, 400, "prompt", "prompt template is not supported"),
        ({"tool_choice": "required"}, 400, "tool_choice", "Tool choice 'required' must"),
        ({"temperature": -1}, 400, "temperature", "temperature must be non-negative"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "body.input", "2 validation"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "Unsupported input"),
        ({"priority": "high"}, 400, "body.priority", "1 validation error:"),
    ],
)
async def test_a_bad_body_is_refused_as_vllm_refuses_it(
    sim: Sim, change: dict[str, Any], status: int, param: str, message: str
) -> None:
    engine = await sim.start()
    answered, answer = await sim.post(engine, RESPONSES, BODY | change)
    assert (answered, answer["error"]["param"], answer["error"]["code"]) == (status, param, status)
    assert answer["error"]["message"].startswith(message), answer


async def test_a_missing_input_is_a_missing_field(sim: Sim) -> None:
    engine = await sim.start()
    status, answer = await sim.post(engine, RESPONSES, {})
    assert status == 400
    assert answer["error"] == {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.input', "
        "'msg': 'Field required', 'input': '<dict of 1 items>'}",
        "type": "Bad Request",
        "param": "body.input",
        "code": 400,
    }


async def test_prompts_at_or_over_the_context_are_refused(sim: Sim) -> None:
    length = len(tokenize(chat_prompt([{"role": "user", "content": PROMPT}])))
    full = await sim.start(max_model_len=length)
    over = await sim.start(max_model_len=length - 1)
    _, at_limit = await sim.post(full, RESPONSES, {"input": PROMPT})
    _, beyond = await sim.post(over, RESPONSES, {"input": PROMPT})
    assert at_limit["error"] == {
        "message": f"The engine prompt length {length} exceeds the max_model_len {length}. "
        "Please reduce prompt.",
        "type": "invalid_request_error",
        "param": "input",
        "code": 400,
    }
    assert beyond["error"]["param"] == "input_tokens"
    assert beyond["error"]["message"].startswith("This model's maximum context length is")


async def test_unknown_members_and_store_are_ignored(sim: Sim) -> None:
    engine = await sim.start()
    body = BODY | {"store": True, "no_such_member": [1, 2], "metadata": {"k": "v"}, "user": "u"}
    status, answer = await sim.post(engine, RESPONSES, body)
    assert status == 200
    assert "store" not in answer
    assert (answer["metadata"], answer["user"]) == ({"k": "v"}, "u")
