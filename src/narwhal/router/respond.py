"""The client's side of a request: its answer written (a relayed stream, one assembled
answer, a consumer's whole answer forwarded, or an error), in the shapes an OpenAI client
expects, through its `Reply`."""

from __future__ import annotations

import contextlib
from typing import Any

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.leg_errors import bad_stream
from narwhal.engines.whole_answer import WholeAnswer
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import NarwhalError
from narwhal.protocol.responses import error_event
from narwhal.protocol.sse import SseError
from narwhal.router.assemble import answer_body
from narwhal.router.assemble_typed import gathered_answer
from narwhal.router.call import Call
from narwhal.router.reply import SSE_HEADERS, Reply

DONE_EVENT = b"data: [DONE]\n\n"


def stream_headers(call: Call) -> dict[str, str]:
    if call.headers:
        return {**SSE_HEADERS, "X-Request-Id": call.request_id, **call.headers}
    return {**SSE_HEADERS, "X-Request-Id": call.request_id}


def answer_headers(call: Call) -> dict[str, str]:
    """A whole answer's headers: its id, and its tenant's rate-limit headers."""
    if call.headers:
        return {"X-Request-Id": call.request_id, **call.headers}
    return {"X-Request-Id": call.request_id}


async def relay(reply: Reply, call: Call, stream: DecodeStream) -> None:
    """Commit the 200 (output exists by now) and forward engine bytes as they come.

    Each block holds everything that had arrived; the last one goes with [DONE] and the
    end of the answer, so a stream costs as few writes as the engine's reads allow. Where
    the reply can write without waiting, plain events go out from the engine's reads
    themselves (`DecodeStream.push_to`) and this loop wakes only for the rest.
    """
    await reply.open_stream(stream_headers(call))
    writer = reply.writer()
    if writer is not None:
        stream.push_to(writer)
    last = b""
    async for data in stream:
        if stream.done:
            last = data
        else:
            await reply.write(data)
    call.output_tokens = completion_tokens(stream.usage)
    call.status = 200
    await reply.end(last + DONE_EVENT)


async def collect(reply: Reply, call: Call, stream: DecodeStream) -> None:
    """The whole stream, then one answer shaped as the engine's own non-streaming one.

    The stream is gathered in bulk; the usual one is checked and assembled in one parse
    (`gathered_answer`), any other decided event by event and folded (`answer_body`).
    """
    endpoint = call.endpoint
    gathered = await stream.rest(lambda events: gathered_answer(endpoint, events))
    if isinstance(gathered, tuple):
        body, usage = gathered
    else:
        try:
            body, usage = answer_body(endpoint, gathered, stream.usage_chunk, stream.usage)
        except SseError as exc:
            # Relayed events only had their framing checked; here each must parse.
            raise bad_stream(exc, stream.engine) from None
    call.output_tokens = completion_tokens(usage)
    call.status = 200
    await reply.answer(200, body, answer_headers(call))


async def forward(reply: Reply, call: Call, answer: WholeAnswer) -> None:
    """The consumer's own non-streaming answer, its bytes as the engine sent them; only the
    `X-Request-Id` header is the router's. Its usage is the request's output count (and
    its prompt count, when no prefill reported one)."""
    call.output_tokens = answer.completion_tokens
    if call.prompt_tokens is None:
        call.prompt_tokens = answer.prompt_tokens
    call.status = 200
    await reply.answer(200, answer.body, answer_headers(call))


def completion_tokens(usage: dict[str, Any] | None) -> int | None:
    tokens = (usage or {}).get("completion_tokens")
    return tokens if type(tokens) is int else None


async def answer_error(reply: Reply, call: Call, error: NarwhalError) -> None:
    """An HTTP error before the 200; a terminal SSE error event after it."""
    if not reply.committed:
        # A client too slow to send its body gets no more time: the connection closes
        # once the answer is out, rather than linger reading the rest.
        await reply.answer(
            error.status,
            error.json(),
            {**answer_headers(call), **error.headers()},
            close=error.status == 408,
        )
        return
    if call.endpoint is Endpoint.RESPONSES:
        # This route's own terminal event: `event: error`, its code the status.
        event = error_event(error.status, error.message, error.param, call.sequence_number + 1)
    else:
        event = error.sse_event()
    with contextlib.suppress(ConnectionResetError):
        await reply.write(event)
        await reply.end()
