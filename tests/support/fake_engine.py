"""A scripted fake engine for each leg behind the real router, over real sockets: the
stack, the answers and streams it scripts, and what a client got back."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from narwhal.app.server import RouterServer, bound_port
from narwhal.config.root import parse_config
from narwhal.protocol.sse import SseDecoder
from support.stack import MODEL

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Script:
    """One scripted answer: `pieces` written one at a time with `pause_s` between them, then
    `forever` repeated until the router hangs up, or the connection cut (`cut`). A pause
    of 0 still yields to the event loop between writes."""

    pieces: tuple[bytes, ...]
    status: int = 200
    content_type: str = "text/event-stream"
    pause_s: float | None = None
    forever: bytes | None = None
    cut: bool = False

    def bytewise(self, pause_s: float = 0.0) -> Script:
        """The same bytes, each its own write: split at every byte boundary."""
        joined = b"".join(self.pieces)
        return replace(
            self, pieces=tuple(joined[i : i + 1] for i in range(len(joined))), pause_s=pause_s
        )


class FakeEngine:
    """Answers every inference request with its script; counts handlers still running."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.active = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(COMPLETIONS, self._answer)
        app.router.add_post(CHAT, self._answer)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = bound_port(site)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            self.bodies.append(await request.json())
            script = self.script
            response = web.StreamResponse(
                status=script.status, headers={"Content-Type": script.content_type}
            )
            await response.prepare(request)
            rest = itertools.repeat(script.forever) if script.forever is not None else ()
            for piece in itertools.chain(script.pieces, rest):
                await response.write(piece)
                if script.pause_s is not None:
                    await asyncio.sleep(script.pause_s)
            if script.cut:
                request.protocol.force_close()
            else:
                await response.write_eof()
            return response
        finally:
            self.active -= 1


# Answers ----------------------------------------------------------------------------------

DESCRIPTOR: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "fake-producer",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def prefill_answer(descriptor: object = DESCRIPTOR, **changes: Any) -> bytes:
    answer: dict[str, Any] = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "kv_transfer_params": descriptor,
        **changes,
    }
    return orjson.dumps(answer)


def json_script(raw: bytes, status: int = 200) -> Script:
    return Script((raw,), status=status, content_type="application/json")


def event(payload: object, end: bytes = b"\n\n") -> bytes:
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return b"data: " + data + end


def chunk(text: object, route: str = COMPLETIONS, finish: object = None) -> dict[str, Any]:
    if route == CHAT:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
    else:
        choice = {"index": 0, "text": text}
    kind = "chat.completion.chunk" if route == CHAT else "text_completion"
    choice["finish_reason"] = finish
    return {"id": "cmpl-fake", "object": kind, "model": MODEL, "choices": [choice]}


TOKENS = ("The", " sea", " is", " deep")
# An event that reports no generated token (any choice would: see `reports_tokens`).
METADATA = {"id": "cmpl-fake", "object": "text_completion", "choices": []}
USAGE = {"id": "cmpl-fake", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
DONE = event(b"[DONE]")


def stream(
    *middle: bytes, route: str = COMPLETIONS, end: bytes = b"\n\n", done: bytes | None = None
) -> Script:
    """A valid stream (first token, `middle`, more tokens, usage, [DONE]) with line ends `end`."""
    first, *rest = TOKENS
    pieces = [event(chunk(first, route), end), *middle]
    pieces += [event(chunk(text, route), end) for text in rest]
    pieces += [event(USAGE, end), event(b"[DONE]", end) if done is None else done]
    return Script(tuple(pieces))


def before_first_token(*pieces: bytes) -> Script:
    return Script((event(METADATA), *pieces, *stream().pieces))


GOOD_PREFILL = json_script(prefill_answer())
GOOD_STREAM = stream()


# The stack --------------------------------------------------------------------------------


@dataclass
class FakeStack:
    router: RouterServer
    producer: FakeEngine
    consumer: FakeEngine
    journal_path: Path
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.router.url


# Short enough that timeout cases end quickly, long enough that a busy machine does not
# make a healthy scripted engine look slow.
ENGINE_TIMEOUT_S = 1.5


@asynccontextmanager
async def fake_stack(
    tmp_path: Path,
    prefill: Script,
    decode: Script,
    deadline_s: float = 4.0,
    engine: dict[str, Any] | None = None,
) -> AsyncIterator[FakeStack]:
    """Router → fake producer p0 and fake consumer d0, with short engine timeouts; the
    deadline stays well above the first-token timeout, so that a busy machine cannot turn
    one into the other. `engine` adds `[engine]` keys."""
    producer, consumer = FakeEngine(prefill), FakeEngine(decode)
    await producer.start()
    await consumer.start()
    journal_path = tmp_path / "journal.jsonl"
    config = parse_config(
        {
            "model": MODEL,
            "journal": {"path": str(journal_path)},
            "engine": {
                "first_token_timeout_s": ENGINE_TIMEOUT_S,
                "decode_read_timeout_s": ENGINE_TIMEOUT_S,
                "prefill_timeout_s": ENGINE_TIMEOUT_S,
                **(engine or {}),
            },
            "serving": {"request_timeout_s": deadline_s, "queue_timeout_s": ENGINE_TIMEOUT_S},
            # Every answer here is bad on purpose: never eject for it.
            "recovery": {"eject_after": 1_000_000},
            "engines": [
                {"id": "p0", "url": producer.url, "role": "prefill"},
                {"id": "d0", "url": consumer.url, "role": "decode"},
            ],
        }
    )
    router = RouterServer(config, port=0)
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            yield FakeStack(router, producer, consumer, journal_path, http)
    finally:
        await router.stop()
        await producer.stop()
        await consumer.stop()


async def nothing_left(stack: FakeStack) -> None:
    """No request in flight, no engine leg open, no seat held, and each fake hung up on."""
    state: dict[str, Any] = {}
    for _ in range(200):
        async with stack.http.get(stack.url + "/narwhal/state") as response:
            state = await response.json()
        fakes_idle = not stack.producer.active and not stack.consumer.active
        if not state["in_flight"] and not state["open_engine_legs"] and fakes_idle:
            break
        await asyncio.sleep(0.01)
    assert state["in_flight"] == 0 and state["queued"] == 0
    assert state["open_engine_legs"] == 0
    for engine in state["engines"]:
        assert engine["seats"]["prefill"]["in_use"] == 0
        assert engine["seats"]["decode"]["in_use"] == 0
    assert stack.producer.active == 0 and stack.consumer.active == 0


def events_of(raw: bytes) -> list[bytes]:
    """The data of every event a client received (our own decoder: any line ends)."""
    return [e.data for e in SseDecoder(max_event_bytes=1 << 30).feed(raw)]


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


async def ask(stack: FakeStack, route: str, stream: bool) -> Answer:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": stream}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    async with stack.http.post(stack.url + route, json=body) as response:
        return Answer(response.status, await response.read())


def terminal_code(answer: Answer) -> int | None:
    """The code of the error event ending a committed stream, or None if it ended cleanly."""
    assert answer.status == 200
    events = events_of(answer.body)
    assert events and events[-1] == b"[DONE]", answer.body[-200:]
    last = orjson.loads(events[-2]) if len(events) > 1 else {}
    code = last.get("error", {}).get("code") if isinstance(last, dict) else None
    return code if isinstance(code, int) else None


def output_of(payload: dict[str, Any], route: str) -> str:
    """The generated text in one event (none in metadata or usage events)."""
    if not payload.get("choices"):
        return ""
    choice = payload["choices"][0]
    return str(choice.get("text") or "" if route == COMPLETIONS else choice["delta"]["content"])


def text_of(answer: Answer, route: str) -> str:
    choice = answer.json["choices"][0]
    return str(choice["text"] if route == COMPLETIONS else choice["message"]["content"])


async def journal(stack: FakeStack, count: int) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for _ in range(200):
        if stack.journal_path.exists():
            lines = [orjson.loads(line) for line in stack.journal_path.read_bytes().splitlines()]
            lines = [line for line in lines if line["type"] == "request"]
            if len(lines) >= count:
                break
        await asyncio.sleep(0.01)
    return lines
