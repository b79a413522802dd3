"""The client load of a soak: concurrent clients on both routes, streaming and not, some
leaving part-way, each recording what it was told."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import aiohttp
import orjson

from narwhal.protocol.sse import SseDecoder
from narwhal.tools.chaos.options import ChaosOptions
from narwhal.tools.sim.model import Generation, Sampling, chat_prompt, tokenize

MODEL = "narwhal-sim"
ROUTES = ("/v1/completions", "/v1/chat/completions")
# Prompts are drawn from a few words: endless new words would only grow the engines' caches.
WORDS = ("the", "sea", "is", "deep", "and", "wide", "whales", "sing", "under", "grey", "skies")
# A client told to come back later (429, 503) waits a moment, as `Retry-After` asks.
BACKOFF_S = 0.1


@dataclass(slots=True)
class Sent:
    """One client request as its client saw it.

    `status` is the HTTP status, or None when the client left before it; `terminal` the
    code of the error event that ended a 200 stream; `broken` what went wrong when the
    connection failed under a client that did not leave.
    """

    index: int
    stream: bool
    left: bool = False
    hung: bool = False
    broken: str | None = None
    status: int | None = None
    terminal: int | None = None
    # For a complete 200 answer: its text as the client assembled it, and the text the
    # simulated engines generate for its request.
    text: str | None = None
    expected: str | None = None

    @property
    def seen(self) -> int | None:
        """The status the client was told, a terminal event's code included."""
        return self.terminal if self.terminal is not None else self.status


def _body(rng: random.Random, route: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 24), "stream": stream}
    text = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
    if route == ROUTES[0]:
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        # Short stop strings end some answers early, some before any text at all.
        body["stop"] = [rng.choice(["e", "th", " s"])]
    return body


def terminal_code(raw: bytes) -> int | None:
    """The code of the error event ending a stream, or None when it ended cleanly."""
    events = [event.data for event in SseDecoder(max_event_bytes=1 << 30).feed(raw)]
    if len(events) < 2 or events[-1] != b"[DONE]":
        return None
    try:
        last = orjson.loads(events[-2])
    except orjson.JSONDecodeError:
        return None
    error = last.get("error") if isinstance(last, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) else None


def answer_text(raw: bytes, *, stream: bool) -> str:
    """The text a client assembles from an answer: its events' pieces, or the object's."""
    if stream:
        payloads = [
            orjson.loads(event.data)
            for event in SseDecoder(max_event_bytes=1 << 30).feed(raw)
            if event.data != b"[DONE]"
        ]
    else:
        payloads = [orjson.loads(raw)]
    parts: list[str] = []
    for payload in payloads:
        for choice in payload.get("choices") or ():
            part = choice.get("delta") or choice.get("message") or choice
            parts.append(part.get("text") or part.get("content") or "")
    return "".join(parts)


def expected_text(raw: bytes) -> str:
    """What the soak's simulated engines generate for this request body, in full."""
    body = orjson.loads(raw)
    if "messages" in body:
        tokens = tokenize(chat_prompt(body["messages"]))
    else:
        tokens = tokenize(body["prompt"])
    generation = Generation(
        tokens, Sampling(), max_tokens=body["max_tokens"], stop=body.get("stop") or ()
    )
    while generation.finish_reason is None:
        generation.step()
    return generation.text


class Sink(Protocol):
    """Where the load reports each request (the soak's tally)."""

    def id_of(self, sent: Sent) -> str: ...

    def add_sent(self, sent: Sent) -> None: ...


class Load:
    """Concurrent clients over one connection pool; each request's choices come from the
    seed and its index alone, so they do not depend on scheduling."""

    def __init__(
        self, url: str, options: ChaosOptions, tally: Sink, give_up_after_s: float
    ) -> None:
        self.url = url
        self.options = options
        self.tally = tally
        self._give_up_after_s = give_up_after_s
        self._index = itertools.count()

    async def run(self, until: float | None) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_body_sent)
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as http,
            asyncio.TaskGroup() as group,
        ):
            for _ in range(self.options.concurrency):
                group.create_task(self._client(http, until))

    async def _client(self, http: aiohttp.ClientSession, until: float | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            index = next(self._index)
            if until is None and index >= self.options.requests:
                return
            if until is not None and loop.time() >= until:
                return
            sent = await self._one(http, index)
            self.tally.add_sent(sent)
            if sent.status in (429, 503):
                await asyncio.sleep(BACKOFF_S)

    async def _one(self, http: aiohttp.ClientSession, index: int) -> Sent:
        rng = random.Random(f"{self.options.seed}:{index}")
        route = rng.choice(ROUTES)
        sent = Sent(index, stream=rng.random() < 0.6)
        raw = orjson.dumps(_body(rng, route, sent.stream))
        leave = rng.random() < self.options.leave_share
        # A client leaves before its answer (only once its body is out, so that the router
        # has the request) or, streaming, after the first bytes of it.
        early = leave and (not sent.stream or rng.random() < 0.5)
        linger_s = rng.uniform(0.0, 0.6)
        body_sent = asyncio.Event()
        exchange = asyncio.create_task(
            self._exchange(http, route, raw, sent, leave=leave, early=early, body_sent=body_sent)
        )
        if early:
            out = asyncio.create_task(body_sent.wait())
            await asyncio.wait([exchange, out], return_when=asyncio.FIRST_COMPLETED)
            out.cancel()
            await asyncio.wait([exchange], timeout=linger_s)
            if not exchange.done():
                sent.left = True
                exchange.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await exchange
        return sent

    async def _exchange(
        self,
        http: aiohttp.ClientSession,
        route: str,
        raw: bytes,
        sent: Sent,
        *,
        leave: bool,
        early: bool,
        body_sent: asyncio.Event,
    ) -> None:
        """Send and read one request. A client leaving early asks for `100 Continue` first,
        so its body (and so the request) reaches the router's handler before it leaves."""
        headers = {"Content-Type": "application/json", "X-Request-Id": self.tally.id_of(sent)}
        timeout = aiohttp.ClientTimeout(total=self._give_up_after_s)
        try:
            async with http.post(
                self.url + route,
                data=raw,
                headers=headers,
                timeout=timeout,
                expect100=early,
                trace_request_ctx=SimpleNamespace(sent=body_sent),
            ) as response:
                sent.status = response.status
                if leave and not early and response.status == 200:
                    first = await response.content.readany()
                    if first and not response.content.at_eof():
                        sent.left = True
                        response.close()
                        return
                    body = first + await response.read()
                else:
                    body = await response.read()
                if sent.stream and response.status == 200:
                    sent.terminal = terminal_code(body)
                if response.status == 200 and sent.terminal is None:
                    sent.text = answer_text(body, stream=sent.stream)
                    sent.expected = expected_text(raw)
        except TimeoutError:
            sent.hung = True
        except aiohttp.ClientError as exc:
            sent.broken = repr(exc)


async def _body_sent(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceRequestChunkSentParams,
) -> None:
    context.trace_request_ctx.sent.set()
