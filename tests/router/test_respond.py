"""An error's answer: an HTTP error before the 200, a terminal event after it, shaped as the
route's clients expect (a Responses stream ends with its own `error` event, numbered next)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import orjson
import pytest

from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError, client_error
from narwhal.router.call import Call
from narwhal.router.respond import answer_error


class Reply:
    """A client connection that records what it is given; gone, its writes fail."""

    def __init__(self, *, committed: bool, gone: bool = False) -> None:
        self.committed = committed
        self.gone = gone
        self.written: list[bytes] = []
        self.ended: list[bytes] = []
        self.answers: list[tuple[int, bytes, dict[str, str], bool]] = []

    async def write(self, data: bytes) -> None:
        if self.gone:
            raise ConnectionResetError("the client closed the connection")
        self.written.append(data)

    async def end(self, data: bytes = b"") -> None:
        if self.gone:
            raise ConnectionResetError("the client closed the connection")
        self.ended.append(data)

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        self.answers.append((status, body, dict(headers), close))


def call(endpoint: Endpoint, sequence_number: int = -1) -> Call:
    record = Call(
        request_id="r1",
        client_request_id=None,
        endpoint=endpoint,
        arrival=time.perf_counter(),
        deadline=asyncio.get_running_loop().time() + 60.0,
    )
    record.sequence_number = sequence_number
    return record


CUT = NarwhalError(502, "engine d0 closed the stream early", Cause.CLOSED_EARLY, engine="d0")


async def answered(reply: Reply, record: Call, error: NarwhalError) -> None:
    await answer_error(reply, record, error)  # type: ignore[arg-type]


async def test_a_committed_responses_stream_ends_with_its_own_error_event() -> None:
    reply = Reply(committed=True)
    await answered(reply, call(Endpoint.RESPONSES, sequence_number=7), CUT)
    assert reply.written == [
        b"event: error\n"
        b'data: {"type":"error","code":"502","message":"engine d0 closed the stream early",'
        b'"param":null,"sequence_number":8}\n\n'
    ]
    assert reply.ended == [b""] and reply.answers == []


async def test_the_responses_error_event_carries_the_status_and_param() -> None:
    reply = Reply(committed=True)
    error = NarwhalError(504, "engine went silent", Cause.SILENCE, param="x")
    await answered(reply, call(Endpoint.RESPONSES, sequence_number=0), error)
    (event,) = reply.written
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert orjson.loads(event.split(b"data: ", 1)[1]) == {
        "type": "error",
        "code": "504",
        "message": "engine went silent",
        "param": "x",
        "sequence_number": 1,
    }
    assert b"[DONE]" not in event


async def test_a_committed_chat_stream_still_ends_with_an_error_object_and_done() -> None:
    reply = Reply(committed=True)
    await answered(reply, call(Endpoint.CHAT, sequence_number=7), CUT)
    assert reply.written == [CUT.sse_event()] and reply.ended == [b""]


@pytest.mark.parametrize("endpoint", [Endpoint.RESPONSES, Endpoint.CHAT])
async def test_before_the_200_an_error_is_an_http_answer(endpoint: Endpoint) -> None:
    reply = Reply(committed=False)
    error = NarwhalError(404, "no response with id 'r9' is stored", Cause.BAD_REQUEST)
    await answered(reply, call(endpoint, sequence_number=3), error)
    assert reply.written == [] and reply.ended == []
    ((status, body, headers, close),) = reply.answers
    assert (status, close) == (404, False)
    assert body == error.json() and headers["X-Request-Id"] == "r1"


async def test_a_client_gone_before_the_error_event_is_no_further_error() -> None:
    reply = Reply(committed=True, gone=True)
    await answered(reply, call(Endpoint.RESPONSES, sequence_number=2), client_error(400, "x"))
    assert reply.written == [] and reply.ended == []
