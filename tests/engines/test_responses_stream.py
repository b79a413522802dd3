"""A Responses decode leg over a connection fed by hand: the events before the first output
delta held and sent first, the end captured with the conversation's members set, and every
way the leg can fail raised with its cause and status."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import Any, cast

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines.gaps import TokenGaps
from narwhal.engines.http import Connection, HttpError, Origin
from narwhal.engines.responses_stream import MAX_HELD_BYTES, ResponsesStream
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.protocol.sse import SseDecoder

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
REWRITE = {"previous_response_id": "resp_before", "store": True}
# The response object as the engine sends it: it was told nothing of the conversation.
ENGINE_RESPONSE: dict[str, Any] = {
    "id": "resp_r1",
    "object": "response",
    "status": "in_progress",
    "model": "m",
    "previous_response_id": None,
    "store": False,
    "output": [],
    "kv_transfer_params": {"remote_block_ids": [1, 2]},
}
MESSAGE = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}


def event(kind: str, number: int | None, **members: Any) -> bytes:
    payload: dict[str, Any] = {"type": kind, **members}
    if number is not None:
        payload["sequence_number"] = number
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def created(number: int = 0) -> bytes:
    return event("response.created", number, response=ENGINE_RESPONSE)


def in_progress(number: int = 1) -> bytes:
    return event("response.in_progress", number, response=ENGINE_RESPONSE)


def added(number: int = 2) -> bytes:
    return event("response.output_item.added", number, output_index=0, item=MESSAGE)


def delta(text: str, number: int, kind: str = "response.output_text.delta") -> bytes:
    return event(kind, number, item_id="msg_1", output_index=0, content_index=0, delta=text)


def final(text: str) -> dict[str, Any]:
    """The engine's response object as a stream ends it."""
    return {
        **ENGINE_RESPONSE,
        "status": "completed",
        "output": [{**MESSAGE, "content": [{"type": "output_text", "text": text}]}],
        "usage": {"input_tokens": 5, "output_tokens": 2},
    }


def completed(text: str, number: int, kind: str = "response.completed") -> bytes:
    return event(kind, number, response=final(text))


def rewritten(response: dict[str, Any]) -> dict[str, Any]:
    """A response object as the client gets it: the conversation's members, no descriptor."""
    seen = {**response, **REWRITE}
    del seen["kv_transfer_params"]
    return seen


def error(number: int, code: object, message: str = "it went wrong") -> bytes:
    return event("error", number, code=code, message=message, param="input")


def failed(number: int, code: object) -> bytes:
    response = {**ENGINE_RESPONSE, "status": "failed", "error": {"code": code, "message": "down"}}
    return event("response.failed", number, response=response)


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def payloads(forwarded: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(e.data) for e in SseDecoder().feed(forwarded)]


class Transport:
    """Enough of a transport for a connection fed by hand; an abort loses the connection."""

    def __init__(self) -> None:
        self.connection: Connection | None = None
        self.aborted = False

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True
        if self.connection is not None:
            self.connection.connection_lost(None)


class Pool:
    """Where a connection goes back once its answer was read to the end."""

    def __init__(self) -> None:
        self.returned: list[Connection] = []

    def put(self, connection: Connection) -> None:
        self.returned.append(connection)


class Leg:
    """A Responses leg's connection, its stream, and what its ending did."""

    def __init__(self, read_timeout_s: float) -> None:
        self.pool = Pool()
        self.transport = Transport()
        self.connection = Connection(cast(Any, self.pool), Origin.of("http://127.0.0.1:1"))
        self.transport.connection = self.connection
        self.connection.connection_made(cast(Any, self.transport))
        self.closed = 0
        self.gaps = TokenGaps()
        self.stream = ResponsesStream(
            self.connection,
            "d0",
            read_timeout_s,
            rewrite=REWRITE,
            on_close=self._closed,
            gaps=self.gaps,
        )

    def _closed(self) -> None:
        self.closed += 1

    def feed(self, *events: bytes) -> None:
        self.connection.data_received(piece(b"".join(events)))

    def end(self) -> None:
        self.connection.data_received(END)


async def open_leg(read_timeout_s: float = 0.0) -> Leg:
    leg = Leg(read_timeout_s)
    leg.connection.send(b"POST /v1/responses HTTP/1.1\r\n\r\n")
    leg.connection.data_received(HEAD)
    assert await leg.connection.head() == 200
    return leg


async def within(pending: Any) -> Any:
    """A regression must fail the test, not hang it."""
    return await asyncio.wait_for(pending, 10)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def started(read_timeout_s: float = 0.0) -> tuple[Leg, bytes]:
    """A leg past its first delta, and the held events the iteration yields first."""
    leg = await open_leg(read_timeout_s)
    leg.feed(created(), in_progress(), added(), delta("He", 3))
    await within(leg.stream.first_output())
    return leg, await within(anext(leg.stream))


async def failure_of(pending: Any) -> NarwhalError:
    with pytest.raises(NarwhalError) as caught:
        await within(pending)
    return caught.value


async def drain(stream: ResponsesStream) -> list[bytes]:
    return [block async for block in stream]


# Up to the first output ----------------------------------------------------------------


async def test_events_before_the_first_delta_are_held_then_go_out_first() -> None:
    leg = await open_leg()
    waiting = asyncio.ensure_future(leg.stream.first_output())
    for before in (created(), in_progress(), added()):
        leg.feed(before)
        await settle()
        assert not waiting.done()
    leg.feed(delta("He", 3))
    await within(waiting)
    first = await within(anext(leg.stream))
    sent = payloads(first)
    assert [p["type"] for p in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_text.delta",
    ]
    # The lifecycle events carry the conversation's members, and no descriptor.
    assert sent[0]["response"] == rewritten(ENGINE_RESPONSE)
    assert sent[1]["response"] == rewritten(ENGINE_RESPONSE)
    assert first.startswith(b"event: response.created\ndata: ")
    # Events without a response object, output above all, go out as the engine sent them.
    assert first.endswith(added() + delta("He", 3))
    assert not leg.stream.done


@pytest.mark.parametrize(
    "kind",
    [
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
    ],
)
async def test_any_delta_is_the_first_output(kind: str) -> None:
    leg = await open_leg()
    leg.feed(created(), delta("{", 1, kind))
    await within(leg.stream.first_output())
    assert (await within(anext(leg.stream))).endswith(delta("{", 1, kind))


async def test_a_stream_that_completes_before_any_delta_is_a_502() -> None:
    leg = await open_leg()
    leg.feed(created(), in_progress(), completed("", 2))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 502 and failure.cause is Cause.DONE_BEFORE_TOKEN
    assert failure.message == "stream ended with response.completed before any output arrived"
    assert failure.transient and failure.engine == "d0"


async def test_an_incomplete_response_before_any_delta_is_a_502_too() -> None:
    leg = await open_leg()
    leg.feed(created(), completed("", 1, "response.incomplete"))
    failure = await failure_of(leg.stream.first_output())
    assert failure.cause is Cause.DONE_BEFORE_TOKEN


async def test_an_error_blaming_the_request_is_relayed_as_the_engine_said() -> None:
    leg = await open_leg()
    leg.feed(created(), error(1, 400, "input is too long"))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 400 and failure.cause is Cause.BAD_REQUEST
    assert not failure.transient and failure.engine == "d0"
    assert failure.relayed == {
        "message": "input is too long",
        "type": "invalid_request_error",
        "param": "input",
        "code": 400,
    }
    assert "input is too long" in failure.message


async def test_an_error_with_a_status_in_a_string_keeps_that_status() -> None:
    leg = await open_leg()
    leg.feed(created(), error(1, "503", "overloaded"))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 503 and failure.cause is Cause.ERROR_OBJECT
    assert failure.transient and failure.relayed is None


async def test_an_error_without_a_status_is_a_502() -> None:
    leg = await open_leg()
    leg.feed(error(0, "oops"))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 502 and failure.cause is Cause.ERROR_OBJECT and failure.transient


async def test_a_failed_response_before_any_delta_keeps_its_errors_status() -> None:
    leg = await open_leg()
    leg.feed(created(), in_progress(), failed(2, 429))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 429 and failure.cause is Cause.ERROR_OBJECT and failure.transient
    assert "down" in failure.message


async def test_a_stream_whose_body_ends_before_any_delta_closed_early() -> None:
    leg = await open_leg()
    waiting = asyncio.ensure_future(leg.stream.first_output())
    leg.feed(created())
    await settle()
    leg.end()
    failure = await failure_of(waiting)
    assert failure.status == 502 and failure.cause is Cause.CLOSED_EARLY and failure.transient


async def test_a_connection_lost_before_any_delta_is_a_transport_failure() -> None:
    # The leg's sender turns it into a CLOSED_EARLY failure, as it does on the other routes.
    leg = await open_leg()
    waiting = asyncio.ensure_future(leg.stream.first_output())
    leg.feed(created())
    await settle()
    leg.connection.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(HttpError):
        await within(waiting)


@pytest.mark.parametrize(
    "garbage",
    [
        b"data: not json\n\n",
        b"data: []\n\n",
        b'event: x\ndata: {"no_type": 1}\n\n',
        b'data: {"type":"response.output_text.delta","delta":"\xff"}\n\n',
    ],
)
async def test_an_event_that_is_not_a_responses_event_is_a_bad_response(garbage: bytes) -> None:
    leg = await open_leg()
    leg.feed(created(), garbage)
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 502 and failure.cause is Cause.BAD_RESPONSE and failure.transient


async def test_an_engine_that_holds_back_output_too_long_is_a_bad_response() -> None:
    leg = await open_leg()
    filler = {"type": "message", "id": "msg_1", "role": "assistant", "note": "x" * (256 << 10)}
    big = event("response.output_item.added", 1, item=filler)
    waiting = asyncio.ensure_future(leg.stream.first_output())
    for _ in range(MAX_HELD_BYTES // len(big) + 2):
        if waiting.done():
            break
        leg.feed(big)
        await settle()
    failure = await failure_of(waiting)
    assert failure.cause is Cause.BAD_RESPONSE and str(MAX_HELD_BYTES) in failure.message


# Past it ---------------------------------------------------------------------------------


async def test_completed_ends_the_stream_with_the_response_rewritten() -> None:
    leg, first = await started()
    async with leg.stream as stream:
        leg.feed(delta("y", 4))
        second = await within(anext(stream))
        leg.feed(event("response.output_text.done", 5, text="Hey"), completed("Hey", 6))
        last = await within(anext(stream))
        ended = stream.done
        after = await within(drain(stream))
        # The body's end comes later: leaving the stream reads up to it.
        asyncio.get_running_loop().call_soon(leg.end)
    assert payloads(first)[-1]["delta"] == "He"
    assert second == delta("y", 4)
    assert ended and after == []
    sent = payloads(last)
    assert [p["type"] for p in sent] == ["response.output_text.done", "response.completed"]
    assert last.startswith(event("response.output_text.done", 5, text="Hey"))
    assert sent[1]["response"] == rewritten(final("Hey"))
    assert sent[1]["sequence_number"] == 6
    assert stream.response == rewritten(final("Hey"))
    assert stream.response["previous_response_id"] == "resp_before"
    assert stream.response["store"] is True and "kv_transfer_params" not in stream.response
    # Read to its end, the connection goes back to the pool.
    assert leg.connection.complete
    assert leg.pool.returned == [leg.connection] and not leg.transport.aborted
    assert leg.closed == 1


async def test_an_incomplete_response_ends_the_stream_well() -> None:
    leg, _ = await started()
    leg.feed(completed("He", 4, "response.incomplete"))
    await within(anext(leg.stream))
    assert leg.stream.done and leg.stream.response == rewritten(final("He"))


async def test_nothing_after_the_end_is_relayed() -> None:
    leg, _ = await started()
    leg.feed(completed("He", 4), delta("late", 5), error(6, 500))
    last = await within(anext(leg.stream))
    assert [p["type"] for p in payloads(last)] == ["response.completed"]
    assert leg.stream.sequence_number == 4


async def test_a_stream_that_ends_with_its_first_delta_is_done_at_once() -> None:
    leg = await open_leg()
    leg.feed(created(), delta("Hi", 1), completed("Hi", 2))
    await within(leg.stream.first_output())
    assert leg.stream.done
    blocks = await within(drain(leg.stream))
    assert len(blocks) == 1
    assert [p["type"] for p in payloads(blocks[0])] == [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ]


async def test_an_end_without_a_response_object_is_a_bad_response() -> None:
    leg, _ = await started()
    leg.feed(event("response.completed", 4))
    failure = await failure_of(anext(leg.stream))
    assert failure.cause is Cause.BAD_RESPONSE


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [(429, 429, True), ("500", 500, True), ("nope", 502, True), (404, 404, False)],
)
async def test_an_error_after_output_is_raised_with_its_status(
    code: object, status: int, transient: bool
) -> None:
    leg, _ = await started()
    leg.feed(delta("y", 4))
    assert await within(anext(leg.stream)) == delta("y", 4)
    leg.feed(error(5, code))
    failure = await failure_of(anext(leg.stream))
    assert failure.status == status and failure.transient is transient
    assert failure.engine == "d0"


async def test_an_error_blaming_the_request_after_output_is_still_that_status() -> None:
    leg, _ = await started()
    leg.feed(error(4, "422", "bad tool output"))
    failure = await failure_of(anext(leg.stream))
    assert failure.status == 422 and failure.cause is Cause.BAD_REQUEST
    assert failure.relayed is not None and failure.relayed["message"] == "bad tool output"


async def test_a_failed_response_after_output_is_raised() -> None:
    leg, _ = await started()
    leg.feed(failed(4, "server_error"))
    failure = await failure_of(anext(leg.stream))
    assert failure.status == 502 and failure.cause is Cause.ERROR_OBJECT
    assert not leg.stream.done


async def test_output_that_came_with_an_error_goes_out_before_it() -> None:
    leg, _ = await started()
    leg.feed(delta("y", 4), delta("!", 5), error(6, 503), delta("late", 7))
    assert await within(anext(leg.stream)) == delta("y", 4) + delta("!", 5)
    # The error's own number is not counted: the router's terminal event takes 6.
    assert leg.stream.sequence_number == 5
    failure = await failure_of(anext(leg.stream))
    assert failure.status == 503 and failure.cause is Cause.ERROR_OBJECT
    assert leg.stream.sequence_number == 5


async def test_output_that_came_with_a_bad_event_goes_out_before_it() -> None:
    leg, _ = await started()
    leg.feed(delta("y", 4), b"data: {oops\n\n", delta("late", 5))
    assert await within(anext(leg.stream)) == delta("y", 4)
    failure = await failure_of(anext(leg.stream))
    assert failure.cause is Cause.BAD_RESPONSE
    assert leg.stream.sequence_number == 4


async def test_an_error_with_the_first_delta_fails_after_it_goes_out() -> None:
    # The delta is output: the client has its 200 and the delta, then the error.
    leg = await open_leg()
    leg.feed(created(0), delta("H", 1), failed(2, 500))
    await within(leg.stream.first_output())
    held = await within(anext(leg.stream))
    assert [p["type"] for p in payloads(held)] == [
        "response.created",
        "response.output_text.delta",
    ]
    failure = await failure_of(anext(leg.stream))
    assert failure.status == 500 and leg.stream.sequence_number == 1


async def test_an_error_with_the_held_events_fails_before_any_output() -> None:
    leg = await open_leg()
    leg.feed(created(0), in_progress(1), error(2, 503), delta("H", 3))
    failure = await failure_of(leg.stream.first_output())
    assert failure.status == 503 and failure.cause is Cause.ERROR_OBJECT


async def test_a_body_that_ends_before_completed_closed_early() -> None:
    leg, _ = await started()
    leg.feed(delta("y", 4))
    leg.end()
    assert await within(anext(leg.stream)) == delta("y", 4)
    failure = await failure_of(anext(leg.stream))
    assert failure.status == 502 and failure.cause is Cause.CLOSED_EARLY and failure.transient
    assert "before response.completed" in failure.message


async def test_a_connection_lost_after_output_closed_early_and_is_not_reused() -> None:
    leg, _ = await started()
    async with leg.stream as stream:
        leg.connection.connection_lost(ConnectionResetError("reset by peer"))
        failure = await failure_of(anext(stream))
        assert failure.cause is Cause.CLOSED_EARLY and "broke" in failure.message
    assert leg.pool.returned == [] and leg.closed == 1


async def test_a_garbage_event_after_output_is_a_bad_response() -> None:
    leg, _ = await started()
    leg.feed(b"data: {oops\n\n")
    failure = await failure_of(anext(leg.stream))
    assert failure.cause is Cause.BAD_RESPONSE and failure.status == 502


async def test_silence_past_the_read_timeout_is_a_504_that_aborts_the_leg() -> None:
    leg, _ = await started(read_timeout_s=0.2)
    async with leg.stream as stream:
        failure = await failure_of(anext(stream))
        assert failure.status == 504 and failure.cause is Cause.SILENCE and failure.transient
        assert "0.2 s" in failure.message
    assert leg.transport.aborted and leg.pool.returned == [] and leg.closed == 1


async def test_the_read_timeout_bounds_each_gap_not_the_whole_stream() -> None:
    # Gaps of a sixth of the timeout, for longer than the timeout in all.
    leg, _ = await started(read_timeout_s=1.5)
    reader = asyncio.ensure_future(drain(leg.stream))
    for number in range(4, 12):
        await asyncio.sleep(0.25)
        leg.feed(delta("x", number))
    leg.feed(completed("He" + "x" * 8, 12))
    sent = payloads(b"".join(await within(reader)))
    assert leg.stream.done
    assert [p["type"] for p in sent] == ["response.output_text.delta"] * 8 + ["response.completed"]
    # Each read's gap was counted.
    assert leg.gaps.count >= 8


async def test_the_first_output_wait_is_the_callers_to_bound() -> None:
    leg = await open_leg(read_timeout_s=0.05)
    waiting = asyncio.ensure_future(leg.stream.first_output())
    await asyncio.sleep(0.3)
    assert not waiting.done()
    leg.feed(delta("a", 0))
    await within(waiting)


async def test_rest_reads_to_the_end_and_returns_the_response() -> None:
    leg = await open_leg()
    leg.feed(created(), delta("H", 1))
    await within(leg.stream.first_output())
    reader = asyncio.ensure_future(leg.stream.rest())
    leg.feed(delta("i", 2))
    await settle()
    leg.feed(event("response.output_text.done", 3, text="Hi"))
    await settle()
    leg.feed(completed("Hi", 4))
    assert await within(reader) == rewritten(final("Hi"))
    assert leg.stream.done and leg.stream.sequence_number == 4


async def test_rest_raises_the_failure_of_the_stream() -> None:
    leg = await open_leg()
    leg.feed(delta("H", 0))
    await within(leg.stream.first_output())
    leg.feed(delta("i", 1), failed(2, "503"))
    failure = await failure_of(leg.stream.rest())
    assert failure.status == 503


async def test_the_sequence_number_is_the_last_decided_events() -> None:
    leg = await open_leg()
    assert leg.stream.sequence_number == -1
    leg.feed(created(0), in_progress(1), added(2), delta("a", 3), delta("b", 4))
    await within(leg.stream.first_output())
    assert leg.stream.sequence_number == 4
    await within(anext(leg.stream))
    leg.feed(delta("c", 5))
    await within(anext(leg.stream))
    assert leg.stream.sequence_number == 5
    # An event without a number leaves the count where it was.
    leg.feed(event("response.output_text.delta", None, delta="d"))
    await within(anext(leg.stream))
    assert leg.stream.sequence_number == 5
    leg.feed(completed("abcd", 6))
    await within(anext(leg.stream))
    assert leg.stream.sequence_number == 6


# However the reads split it ----------------------------------------------------------------


def body_of(texts: list[str]) -> list[bytes]:
    """A whole stream's events, its output the deltas of `texts`."""
    last = 3 + len(texts)
    return [
        created(0),
        in_progress(1),
        added(2),
        *(delta(text, 3 + i) for i, text in enumerate(texts)),
        event("response.output_text.done", last, text="".join(texts)),
        completed("".join(texts), last + 1),
    ]


async def relayed(reads: list[bytes]) -> tuple[bytes, dict[str, Any] | None, int]:
    """What the leg forwards, the response it ends with and its last number, the body
    coming in `reads`."""
    leg = await open_leg()

    async def run() -> list[bytes]:
        await leg.stream.first_output()
        return await drain(leg.stream)

    reader = asyncio.ensure_future(run())
    for data in reads:
        await settle()
        leg.feed(data)
    await settle()
    leg.end()
    blocks = await within(reader)
    return b"".join(blocks), leg.stream.response, leg.stream.sequence_number


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.sampled_from(["a", "bc", "\u00e9", "", " d", "\n"]), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
)
def test_however_the_reads_split_the_events_the_same_bytes_go_out(
    texts: list[str], cuts: list[int]
) -> None:
    events = body_of(texts)
    body = b"".join(events)
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    reads = [body[a:b] for a, b in pairwise(bounds)]
    whole = asyncio.run(relayed([body]))
    assert asyncio.run(relayed(reads)) == whole
    forwarded, response, number = whole
    assert response == rewritten(final("".join(texts)))
    assert number == len(events) - 1
    # Every event goes out once, in order; output exactly as the engine sent it.
    sent = payloads(forwarded)
    assert [p["type"] for p in sent] == [
        orjson.loads(e.split(b"data: ")[1])["type"] for e in events
    ]
    deltas = b"".join(events[3:-2])
    assert deltas in forwarded
