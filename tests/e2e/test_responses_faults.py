"""How each engine fault ends a `/v1/responses` request, streamed and whole: the status and
message the client gets, the router's own `event: error` that ends a committed stream
(numbered after the last event relayed, nothing after it), the journal's one line and
cause, retries that leave no trace of the failed try, and nothing left behind.

The simulator acts out what vLLM 0.32 does (a failure cuts the body, no error event); the
scripted engines send, byte for byte, what it does not: a body ended cleanly without
`response.completed`, and OpenAI's `error` and `response.failed` events."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from support.fake_engine import Script, journal
from support.responses_events import (
    OPENING,
    RESPONSES,
    Received,
    ResponsesStack,
    as_client_sees,
    completed,
    created,
    delta,
    engine_response,
    error,
    failed,
    good_stream,
    in_progress,
    nothing_held,
    numbered,
    received,
    responses_stack,
    terminal,
)
from support.stack import MODEL, Stack, StackFactory, arm, lane_of, settled

pytestmark = pytest.mark.both_lanes

CROSSED = (("p0", "prefill"), ("d0", "decode"))
TWO_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
# Retries may happen; a failing engine is never ejected, so every request can meet it.
RETRY = {"serving": {"max_attempts": 2}, "recovery": {"eject_after": 1000}}
# A healthy engine's first delta comes well within this, on a machine however busy.
FIRST_TOKEN_S = 5.0
# A first-token bound short enough to wait out twice, long enough for a healthy engine on a
# busy machine; and a fault far longer than any bound.
SHORT_S = 2.5
FAULT_S = 10.0
# How many requests may go before placement puts one on d0 first (idle, it is the first).
PLACEMENTS = 20
_OFF_LANE = {"Content-Encoding": "identity"}


def body(stream: bool, text: str = "Tell me about whales") -> dict[str, Any]:
    return {"model": MODEL, "input": text, "max_output_tokens": 12, "stream": stream}


def store(tmp_path: Path) -> dict[str, Any]:
    return {"path": str(tmp_path / "responses.sqlite3")}


# Asking -----------------------------------------------------------------------------------


async def ask(
    http: aiohttp.ClientSession, url: str, sent: dict[str, Any], lane: str
) -> tuple[int, bytes]:
    """POST to the router's `/v1/responses` on `lane`; the status and the body's bytes."""
    headers = {"Content-Type": "application/json", **(_OFF_LANE if lane == "aiohttp" else {})}
    async with http.post(url + RESPONSES, data=orjson.dumps(sent), headers=headers) as response:
        assert lane_of(response.headers.get("Server")) == lane
        if response.status != 200 or not sent["stream"]:
            assert response.content_type == "application/json"
        else:
            assert response.content_type == "text/event-stream"
        return response.status, await response.read()


async def ask_stack(stack: Stack, sent: dict[str, Any]) -> tuple[int, bytes]:
    return await ask(stack.http, stack.url, sent, stack.lane)


# The error types of the statuses these tests see, as the client reads them.
TYPES = {
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_object(code: int, message: str) -> dict[str, Any]:
    """An OpenAI-shaped error object with this status and message (no param)."""
    return {"message": message, "type": TYPES[code], "param": None, "code": code}


def error_of(raw: bytes) -> dict[str, Any]:
    """The error object of a JSON error answer."""
    answer = orjson.loads(raw)
    assert set(answer) == {"error"}, answer
    found: dict[str, Any] = answer["error"]
    return found


def ended_by_router(raw: bytes, code: str, message: str) -> list[Received]:
    """The events of a committed stream the router ended: its own `event: error` with `code`
    and `message`, numbered after the last event relayed, and nothing after it. The events
    before it are returned."""
    events = received(raw)
    assert len(events) >= 2, raw
    *relayed, last = events
    assert last.name == "error", raw[-400:]
    assert last.raw == terminal(code, message, numbered(relayed)[-1] + 1), last.raw
    assert raw.endswith(last.raw)
    assert all(e.name not in ("response.completed", "error") for e in relayed)
    return relayed


def one_clean_stream(events: list[Received], response_id: str) -> dict[str, Any]:
    """A stream as a client must see it: one `response.created`, of the response that ends
    it, numbered from 0 without a gap, at least one delta, `response.completed` last. Its
    response object is returned."""
    names = [e.name for e in events]
    assert names.count("response.created") == 1 and names[0] == "response.created", names
    assert names.count("response.in_progress") == 1, names
    assert names[-1] == "response.completed" and names.count("response.completed") == 1
    assert any(name and name.endswith(".delta") for name in names), names
    assert numbered(events) == list(range(len(events)))
    assert events[0].payload["response"]["id"] == response_id
    final: dict[str, Any] = events[-1].payload["response"]
    assert final["id"] == response_id
    return final


def answered(raw: bytes, stream: bool, response_id: str) -> dict[str, Any]:
    """The response a 200 answer carries: a clean stream's last one, or the whole answer."""
    if stream:
        return one_clean_stream(received(raw), response_id)
    whole: dict[str, Any] = orjson.loads(raw)
    return whole


async def one_line(stack: Stack, requests: int) -> dict[str, Any]:
    """The last request's journal line, once the router has settled; each request wrote
    exactly one."""
    await settled(stack)
    lines = await stack.journal(requests, "request")
    assert len(lines) == requests, lines
    assert all(line["endpoint"] == "/v1/responses" for line in lines)
    return lines[-1]


async def until_retried(stack: Stack, stream: bool) -> tuple[int, bytes, dict[str, Any], int]:
    """Ask, each time with a new input, until a request met d0 first and was retried; its
    status, body, journal line, and how many requests were asked."""
    for count in range(1, PLACEMENTS + 1):
        status, raw = await ask_stack(stack, body(stream, f"Tell me about whale {count}"))
        assert status == 200, raw
        line = (await stack.journal(count, "request"))[-1]
        if line["attempts"] == 2:
            return status, raw, line, count
        assert line["attempts"] == 1 and line["consumer"] == "d1", line
    raise AssertionError(f"no request of {PLACEMENTS} was placed on d0 first")


def check_retried(line: dict[str, Any], cause: str) -> None:
    """The journal of a request whose try on d0 failed before output and whose retry on d1
    answered."""
    assert line["status"] == 200 and line["cause"] is None and line["error"] is None
    assert line["attempts"] == 2 and line["consumer"] == "d1"
    assert line["failures"] == [{"engine": "d0", "cause": cause, "status": 502}]


# The simulator: what vLLM 0.32 does -------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("fault", "cause"),
    [({"close_after": 0}, "closed_early"), ({"done_before_token": True}, "done_before_token")],
)
async def test_a_try_that_ends_before_any_delta_is_retried_on_another_consumer(
    make_stack: StackFactory,
    tmp_path: Path,
    stream: bool,
    fault: dict[str, Any],
    cause: str,
) -> None:
    async with make_stack(
        TWO_CONSUMERS,
        responses=store(tmp_path),
        engine={"first_token_timeout_s": FIRST_TOKEN_S},
        **RETRY,
    ) as stack:
        arm(stack.engine("d0"), phase="decode", **fault)
        _, raw, line, count = await until_retried(stack, stream)
        check_retried(line, cause)
        response_id = "resp_" + line["backend_request_ids"][1]
        # The failed try's response.created and response.in_progress reached the router but
        # never the client.
        final = answered(raw, stream, response_id)
        assert final["id"] == response_id and final["status"] in ("completed", "incomplete")
        assert final["output"] and final["usage"]["output_tokens"] == line["output_tokens"]
        assert await one_line(stack, count) == line


@pytest.mark.parametrize("stream", [True, False])
async def test_a_cut_before_any_delta_with_no_other_consumer_is_502(
    make_stack: StackFactory, tmp_path: Path, stream: bool
) -> None:
    async with make_stack(
        CROSSED,
        responses=store(tmp_path),
        engine={"first_token_timeout_s": FIRST_TOKEN_S},
        **RETRY,
    ) as stack:
        arm(stack.engine("d0"), phase="decode", close_after=0)
        status, raw = await ask_stack(stack, body(stream))
        assert status == 502
        message = (
            "decode stream from engine d0 broke before any token: "
            "connection closed before the answer ended"
        )
        assert error_of(raw) == error_object(502, message)
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "closed_early", message)
        # The retry found d0 alone, and failed there again.
        assert line["attempts"] == 2
        assert line["failures"] == [{"engine": "d0", "cause": "closed_early", "status": 502}] * 2


@pytest.mark.parametrize("stream", [True, False])
async def test_a_completion_before_any_delta_with_no_other_consumer_is_502(
    make_stack: StackFactory, tmp_path: Path, stream: bool
) -> None:
    async with make_stack(
        CROSSED, responses=store(tmp_path), engine={"first_token_timeout_s": FIRST_TOKEN_S}
    ) as stack:
        arm(stack.engine("d0"), phase="decode", done_before_token=True)
        status, raw = await ask_stack(stack, body(stream))
        # A whole answer too is read from a streamed decode.
        assert status == 502
        message = "stream ended with response.completed before any output arrived"
        assert error_of(raw)["message"] == message
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "done_before_token", message)


async def test_a_cut_after_output_ends_the_stream_with_the_routers_502_event(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(
        CROSSED,
        responses=store(tmp_path),
        engine={"first_token_timeout_s": FIRST_TOKEN_S},
        **RETRY,
    ) as stack:
        arm(stack.engine("d0"), phase="decode", close_after=3)
        status, raw = await ask_stack(stack, body(True))
        assert status == 200
        message = "decode stream from engine d0 broke: connection closed before the answer ended"
        relayed = ended_by_router(raw, "502", message)
        names = [e.name for e in relayed]
        assert names[:2] == ["response.created", "response.in_progress"]
        # Three tokens, each a delta unless its text was empty.
        assert 1 <= names.count("response.output_text.delta") <= 3
        assert numbered(relayed) == list(range(len(relayed)))
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "closed_early", message)
        # Output went out: never retried.
        assert line["attempts"] == 1
        assert line["failures"] == [{"engine": "d0", "cause": "closed_early", "status": 502}]
        with pytest.raises(openai.NotFoundError):
            await stack.openai().responses.retrieve(relayed[0].payload["response"]["id"])


async def test_a_cut_after_output_of_a_whole_answer_is_a_502(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(
        CROSSED, responses=store(tmp_path), engine={"first_token_timeout_s": FIRST_TOKEN_S}
    ) as stack:
        arm(stack.engine("d0"), phase="decode", close_after=3)
        status, raw = await ask_stack(stack, body(False))
        assert status == 502
        message = "decode stream from engine d0 broke: connection closed before the answer ended"
        assert error_of(raw) == error_object(502, message)
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "closed_early", message)


@pytest.mark.parametrize("stream", [True, False])
async def test_silence_between_deltas_ends_the_answer_with_a_504(
    make_stack: StackFactory, tmp_path: Path, stream: bool
) -> None:
    async with make_stack(
        CROSSED,
        responses=store(tmp_path),
        engine={"decode_read_timeout_s": 0.5, "first_token_timeout_s": FIRST_TOKEN_S},
    ) as stack:
        arm(stack.engine("d0"), phase="decode", silence_after=3, silence_s=FAULT_S)
        status, raw = await ask_stack(stack, body(stream))
        message = "engine went silent between tokens: engine d0 sent nothing for 0.5 s"
        if stream:
            assert status == 200
            relayed = ended_by_router(raw, "504", message)
            assert 1 <= [e.name for e in relayed].count("response.output_text.delta") <= 3
            assert numbered(relayed) == list(range(len(relayed)))
        else:
            assert status == 504
            assert error_of(raw) == error_object(504, message)
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (504, "silence", message)
        assert line["attempts"] == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_no_delta_within_the_first_token_timeout_is_retried_then_504(
    make_stack: StackFactory, tmp_path: Path, stream: bool
) -> None:
    async with make_stack(
        CROSSED,
        responses=store(tmp_path),
        engine={"first_token_timeout_s": SHORT_S},
        **RETRY,
    ) as stack:
        arm(stack.engine("d0"), phase="decode", first_token_delay_s=FAULT_S)
        status, raw = await ask_stack(stack, body(stream))
        assert status == 504
        message = "engine d0 produced no token within the first-token timeout (2.5 s)"
        assert error_of(raw) == error_object(504, message)
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (
            504,
            "first_token_timeout",
            message,
        )
        assert line["attempts"] == 2
        assert (
            line["failures"]
            == [{"engine": "d0", "cause": "first_token_timeout", "status": 504}] * 2
        )


@pytest.mark.parametrize("stream", [True, False])
async def test_a_first_token_timeout_is_retried_on_another_consumer_unseen(
    make_stack: StackFactory, tmp_path: Path, stream: bool
) -> None:
    async with make_stack(
        TWO_CONSUMERS,
        responses=store(tmp_path),
        engine={"first_token_timeout_s": SHORT_S},
        **RETRY,
    ) as stack:
        arm(stack.engine("d0"), phase="decode", first_token_delay_s=FAULT_S)
        _, raw, line, count = await until_retried(stack, stream)
        assert line["status"] == 200 and line["cause"] is None
        assert line["attempts"] == 2 and line["consumer"] == "d1"
        assert line["failures"] == [{"engine": "d0", "cause": "first_token_timeout", "status": 504}]
        response_id = "resp_" + line["backend_request_ids"][1]
        final = answered(raw, stream, response_id)
        assert final["id"] == response_id
        # The response kept is the one the client got.
        kept = await stack.openai().responses.retrieve(response_id)
        assert kept.id == response_id and kept.output_text
        assert await one_line(stack, count) == line


async def test_the_openai_client_reads_the_routers_terminal_event(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(
        CROSSED,
        responses=store(tmp_path),
        engine={"decode_read_timeout_s": 0.5, "first_token_timeout_s": FIRST_TOKEN_S},
    ) as stack:
        arm(stack.engine("d0"), phase="decode", silence_after=2, silence_s=FAULT_S)
        seen = []
        async with stack.openai().responses.stream(
            model=MODEL, input="Tell me about whales", max_output_tokens=12
        ) as stream:
            async for item in stream:
                seen.append(item)
        *_, last = seen
        assert last.type == "error"
        assert last.code == "504"
        assert last.message == (
            "engine went silent between tokens: engine d0 sent nothing for 0.5 s"
        )
        assert last.sequence_number == seen[-2].sequence_number + 1
        assert 1 <= [item.type for item in seen].count("response.output_text.delta") <= 2
        line = await one_line(stack, 1)
        assert (line["status"], line["cause"]) == (504, "silence")


# Scripted engines: exact bytes, and the events vLLM 0.32 never sends ----------------------


async def ask_fake(
    stack: ResponsesStack, stream: bool, lane: str, go: asyncio.Event | None = None
) -> tuple[int, bytes]:
    """Ask the scripted stack; `go` (a gate on d0's script) is opened once the client holds
    a delta, or at once for a whole answer."""
    if go is None:
        return await ask(stack.http, stack.url, body(stream), lane)
    if not stream:
        go.set()
        return await ask(stack.http, stack.url, body(stream), lane)
    headers = {"Content-Type": "application/json", **(_OFF_LANE if lane == "aiohttp" else {})}
    async with stack.http.post(
        stack.url + RESPONSES, data=orjson.dumps(body(True)), headers=headers
    ) as response:
        assert lane_of(response.headers.get("Server")) == lane
        assert response.status == 200
        raw = b""
        async for piece in response.content.iter_any():
            raw += piece
            if not go.is_set() and any(e.name == DELTA for e in received(raw)):
                go.set()
        return response.status, raw


async def settled_fakes(stack: ResponsesStack, requests: int) -> dict[str, Any]:
    """The last request's journal line, once nothing is held; each request wrote one."""
    await nothing_held(stack)
    lines = await journal(stack, requests)
    assert len(lines) == requests, lines
    return lines[-1]


def script(*pieces: bytes) -> Script:
    """A consumer that writes `pieces` one at a time, then ends its body cleanly."""
    return Script(pieces)


DELTA = "response.output_text.delta"
# The good end, and what the client gets of it.
FINAL = as_client_sees(engine_response("completed", "The sea"))
# Before the first delta: the opening events and the first delta in one write.
FIRST = b"".join((*OPENING, delta("The", 3)))
ENDED_EARLY = (created(0), in_progress(1), completed("", 2))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_whole_answer_is_the_response_of_response_completed(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    async with responses_stack(tmp_path, [good_stream()]) as stack:
        status, raw = await ask_fake(stack, stream, lane)
        assert status == 200
        if stream:
            events = received(raw)
            assert one_clean_stream(events, "resp_fake") == FINAL
            # Deltas go out as the engine wrote them.
            assert [e.raw for e in events if e.name == DELTA] == [
                delta("The", 3),
                delta(" sea", 4),
            ]
        else:
            assert orjson.loads(raw) == FINAL
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["output_tokens"], line["cause"]) == (200, 2, None)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_ended_before_any_delta_is_502_with_no_other_consumer(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    async with responses_stack(tmp_path, [script(*OPENING)], serving={"max_attempts": 2}) as stack:
        status, raw = await ask_fake(stack, stream, lane)
        assert status == 502
        message = "decode stream from engine d0 closed before any token"
        assert error_of(raw) == error_object(502, message)
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "closed_early", message)
        assert line["attempts"] == 2


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("failing", "cause"),
    [
        pytest.param(OPENING, "closed_early", id="closed"),
        pytest.param(ENDED_EARLY, "done_before_token", id="completed"),
    ],
)
async def test_a_scripted_try_ended_before_any_delta_is_retried_elsewhere(
    tmp_path: Path, lane: str, stream: bool, failing: tuple[bytes, ...], cause: str
) -> None:
    async with responses_stack(
        tmp_path, [script(*failing), good_stream()], serving={"max_attempts": 2}
    ) as stack:
        for count in range(1, PLACEMENTS + 1):
            status, raw = await ask_fake(stack, stream, lane)
            assert status == 200, raw
            line = (await journal(stack, count))[-1]
            if line["attempts"] == 2:
                break
        check_retried(line, cause)
        assert answered(raw, stream, "resp_fake") == FINAL
        if stream:
            assert raw.count(b"event: response.created\n") == 1
        assert await settled_fakes(stack, count) == line


@pytest.mark.parametrize("stream", [True, False])
async def test_a_scripted_completion_before_any_delta_is_502(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    async with responses_stack(tmp_path, [script(*ENDED_EARLY)]) as stack:
        status, raw = await ask_fake(stack, stream, lane)
        assert status == 502
        message = "stream ended with response.completed before any output arrived"
        assert error_of(raw)["message"] == message
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "done_before_token", message)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_ended_after_output_without_response_completed_is_502(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    # Streamed, a retry would be allowed were the end seen before output: it is not.
    attempts = 2 if stream else 1
    async with responses_stack(
        tmp_path, [script(FIRST, delta(" sea", 4))], serving={"max_attempts": attempts}
    ) as stack:
        go = stack.hold_before(1)
        status, raw = await ask_fake(stack, stream, lane, go)
        message = "decode stream from engine d0 closed before response.completed"
        if stream:
            assert status == 200
            opening = received(raw)[:3]
            assert [e.name for e in opening] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
            ]
            assert raw == b"".join(
                [
                    *(e.raw for e in opening),
                    delta("The", 3),
                    delta(" sea", 4),
                    terminal("502", message, 5),
                ]
            )
        else:
            assert status == 502
            assert error_of(raw)["message"] == message
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (502, "closed_early", message)
        # Output had come: not tried again.
        assert line["attempts"] == 1


# An engine's own failure: (its event, the client's status, the message's engine part).
BEFORE_OUTPUT = [
    pytest.param(error(429, "slow down", 3), 429, "slow down", id="error-429"),
    pytest.param(error("503", "overloaded", 3), 503, "overloaded", id="error-503-digits"),
    pytest.param(error("server_error", "it broke", 3), 502, "it broke", id="error-server_error"),
    pytest.param(failed("server_error", "it broke", 3), 502, "it broke", id="failed-server_error"),
    pytest.param(failed("503", "overloaded", 3), 503, "overloaded", id="failed-503-digits"),
    pytest.param(failed(429, "slow down", 3), 429, "slow down", id="failed-429"),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("failure", "status", "said"), BEFORE_OUTPUT)
async def test_an_engine_failure_before_output_keeps_its_status(
    tmp_path: Path, lane: str, stream: bool, failure: bytes, status: int, said: str
) -> None:
    async with responses_stack(tmp_path, [script(*OPENING, failure)]) as stack:
        got, raw = await ask_fake(stack, stream, lane)
        assert got == status
        message = f"engine d0 reported an error: {said}"
        assert error_of(raw) == error_object(status, message)
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (status, "error_object", message)
        assert line["failures"] == [{"engine": "d0", "cause": "error_object", "status": status}]


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_400_before_output_is_the_clients_400(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    failure = error(400, "`input` is too long", 3, param="input")
    async with responses_stack(
        tmp_path, [script(*OPENING, failure), good_stream()], serving={"max_attempts": 2}
    ) as stack:
        got, raw = await ask_fake(stack, stream, lane)
        assert got == 400
        # The engine's own error, as it sent it.
        assert error_of(raw) == {
            "message": "`input` is too long",
            "type": "invalid_request_error",
            "param": "input",
            "code": 400,
        }
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"]) == (400, "bad_request")
        # The client's own fault: never tried again.
        assert line["attempts"] == 1 and line["consumer"] == "d0"
        assert not stack.others[0].bodies


@pytest.mark.parametrize("stream", [True, False])
async def test_a_transient_engine_failure_before_output_is_retried_elsewhere(
    tmp_path: Path, lane: str, stream: bool
) -> None:
    failure = error("503", "overloaded", 3)
    async with responses_stack(
        tmp_path, [script(*OPENING, failure), good_stream()], serving={"max_attempts": 2}
    ) as stack:
        for count in range(1, PLACEMENTS + 1):
            status, raw = await ask_fake(stack, stream, lane)
            assert status == 200, raw
            line = (await journal(stack, count))[-1]
            if line["attempts"] == 2:
                break
        assert line["status"] == 200 and line["consumer"] == "d1"
        assert line["failures"] == [{"engine": "d0", "cause": "error_object", "status": 503}]
        assert answered(raw, stream, "resp_fake") == FINAL
        await settled_fakes(stack, count)


# An engine's own failure after output: (its event, the terminal event's code, the message's
# engine part).
AFTER_OUTPUT = [
    pytest.param(error("503", "overloaded", 4), "503", "overloaded", id="error-503-digits"),
    pytest.param(error(503, "overloaded", 4), "503", "overloaded", id="error-503"),
    pytest.param(error(429, "slow down", 4), "429", "slow down", id="error-429"),
    pytest.param(error("server_error", "it broke", 4), "502", "it broke", id="error-server_error"),
    pytest.param(
        failed("server_error", "it broke", 4), "502", "it broke", id="failed-server_error"
    ),
    pytest.param(failed("503", "overloaded", 4), "503", "overloaded", id="failed-503-digits"),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("failure", "code", "said"), AFTER_OUTPUT)
async def test_an_engine_failure_after_output_ends_with_its_status(
    tmp_path: Path, lane: str, stream: bool, failure: bytes, code: str, said: str
) -> None:
    # Streamed, a retry would be allowed were the failure seen before output: it is not.
    attempts = 2 if stream else 1
    async with responses_stack(
        tmp_path, [script(FIRST, failure, delta("never", 5))], serving={"max_attempts": attempts}
    ) as stack:
        go = stack.hold_before(1)
        status, raw = await ask_fake(stack, stream, lane, go)
        message = f"engine d0 reported an error: {said}"
        if stream:
            assert status == 200
            relayed = ended_by_router(raw, code, message)
            assert relayed[-1].raw == delta("The", 3)
            assert numbered(relayed) == [0, 1, 2, 3]
        else:
            assert status == int(code)
            assert error_of(raw)["message"] == message
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (
            int(code),
            "error_object",
            message,
        )
        assert line["attempts"] == 1


async def test_output_sent_with_an_error_in_one_write_reaches_the_client_first(
    tmp_path: Path, lane: str
) -> None:
    """Output the engine sent before its failure goes out first, as on the other routes;
    the router's event is numbered after it."""
    together = delta(" sea", 4) + error("503", "overloaded", 5)
    async with responses_stack(tmp_path, [script(FIRST, together)]) as stack:
        go = stack.hold_before(1)
        status, raw = await ask_fake(stack, True, lane, go)
        assert status == 200
        relayed = ended_by_router(raw, "503", "engine d0 reported an error: overloaded")
        assert [e.raw for e in relayed][3:] == [delta("The", 3), delta(" sea", 4)]
        await settled_fakes(stack, 1)


async def test_silence_after_a_scripted_delta_is_the_routers_504_event(
    tmp_path: Path, lane: str
) -> None:
    async with responses_stack(
        tmp_path, [script(FIRST, delta("never", 4))], engine={"decode_read_timeout_s": 0.5}
    ) as stack:
        # The engine says nothing after its first delta until the router hangs up.
        stack.hold_before(1)
        status, raw = await ask_fake(stack, True, lane)
        assert status == 200
        message = "engine went silent between tokens: engine d0 sent nothing for 0.5 s"
        relayed = ended_by_router(raw, "504", message)
        assert relayed[-1].raw == delta("The", 3)
        assert numbered(relayed) == [0, 1, 2, 3]
        line = await settled_fakes(stack, 1)
        assert (line["status"], line["cause"], line["error"]) == (504, "silence", message)
