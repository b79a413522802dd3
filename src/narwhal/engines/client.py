"""The engine client: both legs of a handoff over pooled keep-alive connections.

`prefill()` runs leg 1 and captures the descriptor; `open_decode()` runs leg 2 up to the
first generated token (so the first-token deadline covers connect, headers and the KV
pull) and returns a `DecodeStream` that relays raw event bytes from then on. Every
failure is raised as a `NarwhalError` whose cause and status are decided here.
"""

from __future__ import annotations

import asyncio
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import aiohttp
import orjson

from narwhal.engines.connector import NIXL_CONNECTOR, Delivery, PrefillResult
from narwhal.engines.gaps import TokenGaps
from narwhal.engines.handoff import checked_descriptor
from narwhal.engines.hosts import HostResolver
from narwhal.engines.http import (
    KEEPALIVE_S,
    ConnectFailed,
    Connection,
    ConnectionPool,
    HttpError,
    TooLarge,
    request_bytes,
)
from narwhal.protocol.bodies import decode_body, prefill_body
from narwhal.protocol.errors import CLIENT_FAULT_STATUSES, Cause, NarwhalError, engine_error
from narwhal.protocol.jsonspan import first_element_span, member_occurrences, member_spans
from narwhal.protocol.sse import (
    EventKind,
    SseDecoder,
    SseError,
    SseEvent,
    block_payloads,
    classify,
    classify_after_first_output,
    error_detail,
    error_status,
)

MAX_PREFILL_ANSWER_BYTES = 8 << 20
MAX_ERROR_BODY_BYTES = 64 << 10
# Events before the first token are held for the client, none dropped; an engine that
# sends more than this before any token is broken (vLLM sends one role chunk at most).
MAX_HELD_BYTES = 1 << 20


def new_request_id() -> str:
    """A fresh backend request id: one per attempt, shared by both of its legs."""
    return uuid.uuid4().hex


class EngineClient:
    """Owns the connection pool to every engine; use as an async context manager."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        prefill_timeout_s: float = 120.0,
        first_token_timeout_s: float = 2.5,
        decode_read_timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.decode_read_timeout_s = decode_read_timeout_s
        extra = {"Content-Type": "application/json", **(headers or {})}
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in extra.items()).encode()
        self._ca_bundle = ca_bundle
        self._hosts = HostResolver()
        self._session: aiohttp.ClientSession | None = None
        self._pool: ConnectionPool | None = None
        # Legs under way: a prefill awaiting its answer or a decode stream not yet closed.
        self.open_legs = 0
        # Gaps between reads of every decode stream past its first token, for metrics.
        self.gaps = TokenGaps()

    async def __aenter__(self) -> Self:
        # https:// engines are verified against the system store, or `ca_bundle` if given.
        context = ssl.create_default_context(cafile=self._ca_bundle) if self._ca_bundle else None
        self._pool = ConnectionPool(connect_timeout_s=self.connect_timeout_s, tls=context)
        tls: ssl.SSLContext | bool = context or True
        # Health and identity checks (off the request path) use a general client.
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=KEEPALIVE_S, enable_cleanup_closed=True, ssl=tls
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient is not open; use `async with EngineClient()`")
        return self._session

    async def _post(
        self,
        url: str,
        endpoint: str,
        body: bytes,
        request_id: str,
        trace: bytes,
        on_sent: Callable[[], None] | None = None,
    ) -> Connection:
        """Send one leg's POST; returns the connection once the answer's head is in."""
        if self._pool is None:
            raise RuntimeError("EngineClient is not open; use `async with EngineClient()`")
        origin = self._pool.origin(url)
        data = request_bytes(endpoint, origin, self._headers, request_id, body, trace)
        return await self._pool.send(origin, data, on_sent)

    # Leg 1 ---------------------------------------------------------------------------

    async def prefill(
        self,
        producer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        same_worker: bool = False,
        request_id: str | None = None,
        engine: str | None = None,
        kv_hosts: Iterable[str] = (),
        trace: bytes = b"",
    ) -> PrefillResult:
        """Run the one-token prefill and capture the producer's descriptor.

        With `same_worker`, no blocks are requested: the decode that follows on the same
        engine finds the prompt in its prefix cache. `trace` is the leg's trace context, as
        header lines.
        """
        name = engine or producer_url
        request_id = request_id or new_request_id()
        started_at = asyncio.get_running_loop().time()
        data = prefill_body(body, crossed=not same_worker)
        self.open_legs += 1
        connection: Connection | None = None
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                connection = await self._post(producer_url, endpoint, data, request_id, trace)
                if connection.status != 200:
                    raise await _status_error(connection, name, "prefill")
                raw = await connection.read_all(MAX_PREFILL_ANSWER_BYTES)
        except TooLarge:
            raise engine_error(
                Cause.BAD_RESPONSE,
                f"engine {name} answered more than {MAX_PREFILL_ANSWER_BYTES} bytes",
                name,
            ) from None
        except HttpError as exc:
            raise _transport_error(exc, name, "prefill") from None
        except TimeoutError:
            raise engine_error(
                Cause.PREFILL_TIMEOUT,
                f"prefill on engine {name} did not answer within {self.prefill_timeout_s:g} s",
                name,
            ) from None
        finally:
            self.open_legs -= 1
            if connection is not None:
                # Back to the pool only when its answer was read to the end.
                connection.release()
        descriptor, prompt_tokens = _parse_prefill_answer(raw, name)
        return PrefillResult(
            producer_url=producer_url,
            endpoint=endpoint,
            request_id=request_id,
            descriptor=None if same_worker else descriptor,
            started_at=started_at,
            prompt_tokens=prompt_tokens,
            same_worker=same_worker,
            kv_hosts=tuple(kv_hosts),
            producer=name,
        )

    # Leg 2 ---------------------------------------------------------------------------

    async def open_decode(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        *,
        engine: str | None = None,
        connector: str = NIXL_CONNECTOR,
        drop_usage: bool = False,
        delivery: Delivery | None = None,
    ) -> DecodeStream:
        """Validate the handoff, send the decode and wait for its first generated token.

        The first-token budget starts before the request is sent, so connect and header
        delays spend it too. On return the stream has output; nothing has been relayed.
        `delivery` learns whether the descriptor reached the consumer, on every path.
        """
        descriptor = await self.handoff_descriptor(consumer_url, endpoint, result, connector)
        return await self.send_decode(
            consumer_url,
            endpoint,
            body,
            result,
            descriptor,
            engine=engine,
            drop_usage=drop_usage,
            delivery=delivery,
        )

    async def send_decode(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        drop_usage: bool = False,
        trace: bytes = b"",
        delivery: Delivery | None = None,
    ) -> DecodeStream:
        """`open_decode` after the handoff check: `descriptor` is what `handoff_descriptor` gave.

        `trace` is the leg's trace context, as header lines; `delivery` learns whether the
        descriptor reached the consumer, on every path.
        """
        name = engine or consumer_url
        data = decode_body(body, descriptor)
        self.open_legs += 1
        connection: Connection | None = None
        decoder = SseDecoder()
        held: list[SseEvent] = []
        held_bytes = 0
        try:
            async with asyncio.timeout(self.first_token_timeout_s):
                connection = await self._post(
                    consumer_url,
                    endpoint,
                    data,
                    result.request_id,
                    trace,
                    None if delivery is None else delivery.sent,
                )
                if connection.status != 200:
                    if delivery is not None:
                        delivery.refused = True
                    raise await _status_error(connection, name, "decode")
                while True:
                    chunk = await connection.read()
                    if not chunk:
                        raise engine_error(
                            Cause.CLOSED_EARLY,
                            f"decode stream from engine {name} closed before any token",
                            name,
                        )
                    # One event at a time: what follows the first token stays buffered
                    # for the stream, which relays it as a block.
                    try:
                        events = decoder.feed(chunk, limit=1)
                        while events:
                            event = events[0]
                            kind = _classify_pre_output(event, name)
                            if kind is EventKind.OUTPUT:
                                held.append(event)
                                return DecodeStream(
                                    connection,
                                    name,
                                    self.decode_read_timeout_s,
                                    decoder,
                                    first=held,
                                    drop_usage=drop_usage,
                                    on_close=self._leg_closed,
                                    gaps=self.gaps,
                                )
                            # The usage chunk the router asked for on its own is not
                            # the client's to see; everything else is.
                            if kind is not EventKind.USAGE or not drop_usage:
                                held.append(event)
                                held_bytes += len(event.raw)
                                if held_bytes > MAX_HELD_BYTES:
                                    raise engine_error(
                                        Cause.BAD_RESPONSE,
                                        f"engine {name} sent more than {MAX_HELD_BYTES} bytes "
                                        "of events before its first token",
                                        name,
                                    )
                            events = decoder.feed(b"", limit=1)
                    except SseError as exc:
                        raise _bad_stream(exc, name) from None
        except HttpError as exc:
            self._leg_closed()
            _close(connection)
            if connection is None:
                raise _transport_error(exc, name, "decode") from None
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {name} broke before any token: {exc}",
                name,
            ) from None
        except TimeoutError:
            self._leg_closed()
            _close(connection)
            raise engine_error(
                Cause.FIRST_TOKEN_TIMEOUT,
                f"engine {name} produced no token within the first-token timeout "
                f"({self.first_token_timeout_s:g} s)",
                name,
            ) from None
        except BaseException:
            self._leg_closed()
            _close(connection)
            raise

    def _leg_closed(self) -> None:
        self.open_legs -= 1

    async def handoff_descriptor(
        self,
        consumer_url: str,
        endpoint: str,
        result: PrefillResult,
        connector: str = NIXL_CONNECTOR,
    ) -> bytes | None:
        """The descriptor to send, after every rule (see `handoff.checked_descriptor`)."""
        return await checked_descriptor(self._hosts, consumer_url, endpoint, result, connector)

    async def decode(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
    ) -> AsyncIterator[dict[str, Any]]:
        """The decode stream's events as dicts (generated output, metadata and usage)."""
        stream = await self.open_decode(consumer_url, endpoint, body, result)
        async with stream:
            async for payload in stream_payloads(stream):
                yield payload


class DecodeStream:
    """An open decode leg past its first token: engine bytes out, failures raised.

    Iterating yields, per transport read, the bytes to forward: whole events exactly as
    the engine sent them, never `[DONE]` or an error object. A read whose complete events
    need no decision is forwarded as one block without per-event work (see
    `SseDecoder.feed_plain`). Silence between reads longer than `read_timeout_s`
    (0 = unbounded) ends the stream with a 504. One clock read per chunk serves the
    watchdog and the gap count (`gaps`, shared by the client's streams).
    """

    def __init__(
        self,
        connection: Connection,
        engine: str,
        read_timeout_s: float,
        decoder: SseDecoder,
        *,
        first: list[SseEvent],
        drop_usage: bool,
        on_close: Callable[[], None],
        gaps: TokenGaps,
    ) -> None:
        self.engine = engine
        self.usage: dict[str, Any] | None = None
        # The usage chunk when it was not forwarded: it also carries the fingerprint.
        self.usage_chunk: dict[str, Any] | None = None
        self.done = False
        self._connection = connection
        self._decoder = decoder
        self._first: list[SseEvent] | None = first
        # The decoder may still hold events that arrived with the first token.
        self._buffered = True
        self._drop_usage = drop_usage
        self._on_close: Callable[[], None] | None = on_close
        self._gaps = gaps
        self._loop = asyncio.get_running_loop()
        self._last_read = self._loop.time()
        self._watchdog = (
            _Watchdog(self._loop, read_timeout_s, connection.close) if read_timeout_s else None
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection to the pool after [DONE]; otherwise close it (aborts)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.done and self._connection.complete:
            self._connection.release()
        else:
            self._connection.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            events, self._first = self._first, None
            return _joined(events)
        decoder = self._decoder
        while not self.done:
            if self._buffered:
                self._buffered = False
                chunk = b""
            else:
                chunk = await self._read()
                now = self._loop.time()
                self._gaps.add(now - self._last_read)
                self._last_read = now
                if self._watchdog is not None:
                    self._watchdog.last = now
            plain = decoder.feed_plain(chunk)
            if decoder.ready():
                self._buffered = True
            if plain:
                return plain
            if not self._buffered:
                continue
            self._buffered = False
            try:
                events = self._decide(decoder.feed(b""))
            except SseError as exc:
                raise _bad_stream(exc, self.engine) from None
            if events:
                return _joined(events)
        await self._finish()
        raise StopAsyncIteration

    async def _finish(self) -> None:
        """After [DONE], read to the end of the answer so the connection can be reused."""
        try:
            while await self._connection.read():
                pass
        except HttpError:
            pass

    async def _read(self) -> bytes:
        try:
            chunk = await self._connection.read()
        except HttpError as exc:
            self._raise_if_silent()
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {self.engine} broke: {exc}",
                self.engine,
            ) from None
        if not chunk:
            self._raise_if_silent()
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode stream from engine {self.engine} closed before [DONE]",
                self.engine,
            )
        return chunk

    def _raise_if_silent(self) -> None:
        if self._watchdog is not None and self._watchdog.fired:
            raise engine_error(
                Cause.SILENCE,
                f"engine went silent between tokens: engine {self.engine} sent nothing for "
                f"{self._watchdog.timeout:g} s",
                self.engine,
            )

    def _decide(self, events: list[SseEvent]) -> list[SseEvent]:
        forward: list[SseEvent] = []
        for event in events:
            try:
                decision = classify_after_first_output(event.data)
            except SseError as exc:
                raise _bad_stream(exc, self.engine) from None
            if decision is None:
                forward.append(event)
            elif decision.kind is EventKind.DONE:
                self.done = True
                break
            elif decision.kind is EventKind.ERROR:
                raise _error_object(decision.payload or {}, self.engine)
            elif decision.kind is EventKind.USAGE:
                self.usage = _usage_of(decision.payload)
                if not self._drop_usage:
                    forward.append(event)
                else:
                    self.usage_chunk = decision.payload
            else:
                forward.append(event)
        return forward


def _joined(events: list[SseEvent]) -> bytes:
    return events[0].raw if len(events) == 1 else b"".join(event.raw for event in events)


async def stream_payloads(stream: DecodeStream) -> AsyncIterator[dict[str, Any]]:
    """The forwarded events of a stream as parsed chunks, for callers that need them all."""
    decoder = SseDecoder()
    async for data in stream:
        try:
            payloads = [classify(event.data).payload for event in decoder.feed(data)]
        except SseError as exc:
            # Relayed events only had their framing checked; here each must parse.
            raise _bad_stream(exc, stream.engine) from None
        for payload in payloads:
            if payload is not None:
                yield payload


async def collect_payloads(stream: DecodeStream) -> list[dict[str, Any]]:
    """Every chunk of a stream, parsed once it has ended (a non-streaming answer's input),
    the usage chunk included."""
    blocks = [data async for data in stream]
    try:
        payloads = block_payloads(b"".join(blocks))
    except SseError as exc:
        # Relayed events only had their framing checked; here each must parse.
        raise _bad_stream(exc, stream.engine) from None
    if stream.usage_chunk is not None:
        payloads.append(stream.usage_chunk)
    return payloads


class _Watchdog:
    """Fires `on_silence` once no chunk has arrived for `timeout` seconds.

    The reader only stamps `last`; the timer re-arms itself lazily, so a busy stream
    costs no timer churn per chunk.
    """

    __slots__ = ("_handle", "_on_silence", "fired", "last", "loop", "timeout")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout: float, on_silence: Callable[[], None]
    ) -> None:
        self.loop = loop
        self.timeout = timeout
        self.last = loop.time()
        self.fired = False
        self._on_silence = on_silence
        self._handle = loop.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = self.last + self.timeout
        if self.loop.time() >= due:
            self.fired = True
            self._on_silence()
        else:
            self._handle = self.loop.call_at(due, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


def _classify_pre_output(event: SseEvent, engine: str) -> EventKind:
    try:
        decision = classify(event.data)
    except SseError as exc:
        raise _bad_stream(exc, engine) from None
    if decision.kind is EventKind.DONE:
        raise engine_error(
            Cause.DONE_BEFORE_TOKEN, "stream ended with [DONE] before any token arrived", engine
        )
    if decision.kind is EventKind.ERROR:
        raise _error_object(decision.payload or {}, engine)
    return decision.kind


def _bad_stream(exc: SseError, engine: str) -> NarwhalError:
    return engine_error(
        Cause.BAD_RESPONSE, f"engine {engine} sent a malformed stream: {exc}", engine
    )


def _error_object(payload: dict[str, Any], engine: str) -> NarwhalError:
    status, message = error_status(payload)
    return engine_error(
        Cause.ERROR_OBJECT,
        f"engine {engine} reported an error: {message}",
        engine,
        status=status,
        detail=error_detail(payload),
    )


def _usage_of(payload: dict[str, Any] | None) -> dict[str, Any] | None:
    usage = (payload or {}).get("usage")
    return usage if isinstance(usage, dict) else None


def _close(connection: Connection | None) -> None:
    if connection is not None:
        connection.close()


async def _status_error(connection: Connection, engine: str, leg: str) -> NarwhalError:
    """A non-200 answer: the engine's own message, with the status's meaning decided once."""
    detail: dict[str, Any] | None = None
    try:
        payload = orjson.loads(await connection.read_all(MAX_ERROR_BODY_BYTES))
        if isinstance(payload, dict):
            _, message = error_status(payload)
            detail = error_detail(payload)
        else:
            message = ""
    except (HttpError, orjson.JSONDecodeError):
        message = ""
    status = connection.status
    if not message:
        message = connection.reason or "no error message"
    if status in CLIENT_FAULT_STATUSES:
        text = message
    else:
        text = f"{leg} on engine {engine} failed with HTTP {status}: {message}"
    return engine_error(Cause.HTTP_STATUS, text, engine, status=status, detail=detail)


def _transport_error(exc: HttpError, engine: str, leg: str) -> NarwhalError:
    if isinstance(exc, ConnectFailed):
        return engine_error(
            Cause.CONNECT, f"could not connect to engine {engine} for {leg}: {exc}", engine
        )
    return engine_error(
        Cause.CONNECT, f"connection to engine {engine} failed during {leg}: {exc}", engine
    )


def _parse_prefill_answer(raw: bytes, engine: str) -> tuple[bytes | None, int | None]:
    """The raw descriptor (None if null or absent) and the prompt's token count."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise engine_error(
            Cause.BAD_RESPONSE,
            f"engine {engine} sent a prefill answer that is not a completion",
            engine,
        )
    usage = answer.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    tokens = prompt_tokens if type(prompt_tokens) is int else None
    found = member_occurrences(raw, "kv_transfer_params")
    if not found:
        return None, tokens
    if len(found) == 1:
        descriptor = raw[found[0][0] : found[0][1]]
        return (None if descriptor == b"null" else descriptor), tokens
    # More than one: the top-level one wins over the first choice's.
    spans = member_spans(raw)
    span = spans.get("kv_transfer_params")
    if span is None and answer["choices"]:
        # Some versions put it inside the first choice.
        first = first_element_span(raw, spans["choices"][0])
        if first is not None and isinstance(answer["choices"][0], dict):
            span = member_spans(raw, first[0]).get("kv_transfer_params")
    if span is None:
        return None, tokens
    descriptor = raw[span[0] : span[1]]
    return (None if descriptor == b"null" else descriptor), tokens
