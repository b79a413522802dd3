"""Scripted engines for `/v1/responses`: the events of a Responses stream written by hand to
the byte (what vLLM 0.32 sends, and the `error` and `response.failed` events it never
does), a stack of one producer and scripted consumers behind the real router, and what a
client's stream holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from narwhal.app.server import RouterServer, bound_port
from narwhal.config.root import parse_config
from narwhal.protocol.sse import SseDecoder
from support.fake_engine import (
    DESCRIPTOR,
    FakeEngine,
    FakeStack,
    Script,
    json_script,
    nothing_left,
)
from support.stack import MODEL

RESPONSES = "/v1/responses"
ITEM_ID = "msg_fake"
# Every bound of a scripted stack: far above what a healthy script takes on a busy machine.
# A test of a timeout sets its own, short, bound.
ENGINE_TIMEOUT_S = 5.0


class ResponsesEngine(FakeEngine):
    """A scripted engine that answers `POST /v1/responses` with its script's pieces (its
    `forever` and `cut` are not used: the body always ends cleanly); with a gate
    (`hold_before`), part of the script waits until the test opens it."""

    def __init__(self, script: Script) -> None:
        super().__init__(script)
        self._gate: tuple[int, asyncio.Event] | None = None

    def hold_before(self, index: int) -> asyncio.Event:
        """Piece `index` of the script, and those after it, wait until the event returned
        is set: what the router relays meanwhile reaches the client first, however busy
        the machine."""
        go = asyncio.Event()
        self._gate = (index, go)
        return go

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(RESPONSES, self._scripted)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = bound_port(site)

    async def _scripted(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            self.bodies.append(await request.json())
            script = self.script
            response = web.StreamResponse(
                status=script.status, headers={"Content-Type": script.content_type}
            )
            await response.prepare(request)
            for index, piece in enumerate(script.pieces):
                if self._gate is not None and self._gate[0] == index:
                    await self._gate[1].wait()
                await response.write(piece)
                if script.pause_s is not None:
                    await asyncio.sleep(script.pause_s)
            await response.write_eof()
            return response
        finally:
            self.active -= 1


# Events ------------------------------------------------------------------------------------


def engine_response(status: str = "in_progress", text: str | None = None) -> dict[str, Any]:
    """The response object an engine's lifecycle events carry: the engine was told to store
    nothing and of no earlier response (the router keeps the conversation)."""
    output: list[Any] = []
    if text is not None:
        output = [
            {
                "id": ITEM_ID,
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
    response: dict[str, Any] = {
        "id": "resp_fake",
        "object": "response",
        "created_at": 1,
        "model": MODEL,
        "status": status,
        "output": output,
        "previous_response_id": None,
        "store": False,
        "usage": None,
        "kv_transfer_params": None,
    }
    if text is not None:
        response["usage"] = {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
    return response


def event(kind: str, number: int, **members: Any) -> bytes:
    """One event as vLLM writes it: its type named on the `event:` line and in the data."""
    payload = {"type": kind, **members, "sequence_number": number}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def created(number: int = 0) -> bytes:
    return event("response.created", number, response=engine_response())


def in_progress(number: int = 1) -> bytes:
    return event("response.in_progress", number, response=engine_response())


def item_added(number: int = 2) -> bytes:
    item = {"id": ITEM_ID, "type": "message", "role": "assistant", "content": []}
    return event("response.output_item.added", number, output_index=0, item=item)


def delta(text: str, number: int) -> bytes:
    return event(
        "response.output_text.delta",
        number,
        item_id=ITEM_ID,
        output_index=0,
        content_index=0,
        delta=text,
        logprobs=[],
    )


def completed(text: str, number: int) -> bytes:
    return event("response.completed", number, response=engine_response("completed", text))


def error(code: object, message: str, number: int, param: str | None = None) -> bytes:
    """The `error` event of OpenAI's Responses stream (vLLM 0.32 has none)."""
    return event("error", number, code=code, message=message, param=param)


def failed(code: object, message: str, number: int) -> bytes:
    """`response.failed`: the response, its `error` saying why (vLLM 0.32 has none)."""
    response = {**engine_response("failed"), "error": {"code": code, "message": message}}
    return event("response.failed", number, response=response)


# Before the first delta: what every stream opens with.
OPENING = (created(0), in_progress(1), item_added(2))
TEXTS = ("The", " sea")


def good_stream() -> Script:
    """A whole stream: opened, two deltas, completed."""
    return Script((*OPENING, delta(TEXTS[0], 3), delta(TEXTS[1], 4), completed("".join(TEXTS), 5)))


def prefill_answer() -> bytes:
    """A producer's one-token Responses answer, with the handoff's descriptor."""
    answer = {
        **engine_response("incomplete", "The"),
        "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6},
        "kv_transfer_params": DESCRIPTOR,
    }
    return orjson.dumps(answer)


GOOD_PREFILL = json_script(prefill_answer())


def as_client_sees(response: dict[str, Any]) -> dict[str, Any]:
    """A response object as the router relays it: the conversation's members set (a first
    turn, stored by default) and no descriptor."""
    seen = {**response, "previous_response_id": None, "store": True}
    del seen["kv_transfer_params"]
    return seen


def terminal(code: str, message: str, number: int) -> bytes:
    """The router's own last event on a committed Responses stream, byte for byte."""
    data = {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": number,
    }
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


# What a client got ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One event a client read: its whole bytes, its `event:` name and its payload."""

    raw: bytes
    name: str | None
    payload: dict[str, Any]


def received(body: bytes) -> list[Received]:
    """The events of a client's stream, in order; each must be a JSON object whose `type`
    is the `event:` line's name."""
    events = []
    for sse in SseDecoder(max_event_bytes=1 << 30).feed(body):
        names = [line[7:] for line in sse.raw.split(b"\n") if line.startswith(b"event: ")]
        name = names[0].decode() if names else None
        payload = orjson.loads(sse.data)
        assert isinstance(payload, dict), sse.raw
        assert payload["type"] == name, sse.raw
        events.append(Received(sse.raw, name, payload))
    return events


def numbered(events: Sequence[Received]) -> list[int]:
    return [int(e.payload["sequence_number"]) for e in events]


# The stack -----------------------------------------------------------------------------------


@dataclass
class ResponsesStack(FakeStack):
    """The router, its producer p0, its consumer d0 and any other consumers (d1, …)."""

    others: tuple[FakeEngine, ...] = ()
    # d0, as its own class: its script can be held (`hold_before`).
    d0: ResponsesEngine | None = None

    def hold_before(self, index: int) -> asyncio.Event:
        """d0's piece `index` on waits until the event returned is set."""
        assert self.d0 is not None
        return self.d0.hold_before(index)


@asynccontextmanager
async def responses_stack(
    tmp_path: Path,
    decodes: Sequence[Script],
    *,
    prefill: Script = GOOD_PREFILL,
    serving: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> AsyncIterator[ResponsesStack]:
    """Router → scripted producer p0 and one scripted consumer per script (d0, d1, …), with
    the breaker of `fake_engine.fake_stack` that never ejects; `serving` and `engine` add
    keys to their sections."""
    producer = ResponsesEngine(prefill)
    consumers = [ResponsesEngine(script) for script in decodes]
    for fake in (producer, *consumers):
        await fake.start()
    journal_path = tmp_path / "journal.jsonl"
    config = parse_config(
        {
            "model": MODEL,
            "journal": {"path": str(journal_path)},
            "responses": {"path": str(tmp_path / "responses.sqlite3")},
            "engine": {
                "first_token_timeout_s": ENGINE_TIMEOUT_S,
                "decode_read_timeout_s": ENGINE_TIMEOUT_S,
                "prefill_timeout_s": ENGINE_TIMEOUT_S,
                **(engine or {}),
            },
            "serving": {
                "request_timeout_s": 4 * ENGINE_TIMEOUT_S,
                "queue_timeout_s": ENGINE_TIMEOUT_S,
                **(serving or {}),
            },
            "recovery": {"eject_after": 1_000_000},
            "engines": [
                {"id": "p0", "url": producer.url, "role": "prefill"},
                *(
                    {"id": f"d{index}", "url": fake.url, "role": "decode"}
                    for index, fake in enumerate(consumers)
                ),
            ],
        }
    )
    router = RouterServer(config, port=0)
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            first, *others = consumers
            yield ResponsesStack(router, producer, first, journal_path, http, tuple(others), first)
    finally:
        await router.stop()
        for fake in (producer, *consumers):
            await fake.stop()


async def nothing_held(stack: ResponsesStack) -> None:
    """As `fake_engine.nothing_left`, and every other consumer hung up on as well."""
    await nothing_left(stack)
    for _ in range(200):
        if not any(fake.active for fake in stack.others):
            break
        await asyncio.sleep(0.01)
    assert not any(fake.active for fake in stack.others)
