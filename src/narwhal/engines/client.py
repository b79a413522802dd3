"""The engine client: both legs of a handoff over pooled keep-alive connections.

`prefill()` runs leg 1 and captures the descriptor; `open_decode()` runs leg 2 up to the
first generated token (so the first-token deadline covers connect, headers and the KV
pull) and returns a `DecodeStream` that relays raw event bytes from then on. Every
failure is raised as a `NarwhalError` whose cause and status are decided where it arises
(`leg_errors`); the stream past the first token is `decode_stream.DecodeStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import aiohttp

from narwhal.engines.connector import NIXL_CONNECTOR, Delivery, PrefillResult
from narwhal.engines.decode_stream import DecodeStream, stream_payloads
from narwhal.engines.gaps import TokenGaps
from narwhal.engines.handoff import checked_descriptor
from narwhal.engines.hosts import HostResolver
from narwhal.engines.http import (
    KEEPALIVE_S,
    Connection,
    ConnectionPool,
    HttpError,
    TooLarge,
    get_bytes,
    request_bytes,
)
from narwhal.engines.leg_errors import bad_stream, error_object, status_error, transport_error
from narwhal.engines.prefill_answer import parse_prefill_answer
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.engines.whole_answer import WholeAnswer, parse_whole_answer
from narwhal.protocol import responses
from narwhal.protocol.bodies import Endpoint, decode_body, prefill_body, whole_decode_body
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.protocol.ids import new_id
from narwhal.protocol.sse import (
    EventKind,
    SseDecoder,
    SseError,
    SseEvent,
    classify,
)
from narwhal.runtime.clock import clock

MAX_PREFILL_ANSWER_BYTES = 8 << 20
# Events before the first token are held for the client, none dropped; an engine that
# sends more than this before any token is broken (vLLM sends one role chunk at most).
MAX_HELD_BYTES = 1 << 20
# A whole answer past this is refused as broken (logprobs of long answers stay far below).
MAX_WHOLE_ANSWER_BYTES = 64 << 20
# An engine's /metrics or /v1/models read off the request path.
FETCH_LIMIT = 16 << 20


@dataclass(frozen=True, slots=True)
class LegBounds:
    """How long one request's legs may take: the client's own (from `[engine]`), or a
    model's (`[[models]] engine`), made once at startup and passed with each leg."""

    prefill_timeout_s: float
    first_token_timeout_s: float
    # 0: unbounded.
    decode_read_timeout_s: float
    # A decode asked for whole, passed to `send_whole` as its `timeout_s` (0: unbounded).
    whole_answer_timeout_s: float = 0.0


def new_request_id() -> str:
    """A fresh backend request id: one per attempt, shared by both of its legs."""
    return new_id()


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
        # The legs' bounds when a call passes none of its own.
        self.bounds = LegBounds(prefill_timeout_s, first_token_timeout_s, decode_read_timeout_s)
        extra = {"Content-Type": "application/json", **(headers or {})}
        # For requests off the hot path, sent through `session`.
        self.headers = extra
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in extra.items()).encode()
        self._ca_bundle = ca_bundle
        self._hosts = HostResolver()
        self._session: aiohttp.ClientSession | None = None
        self._pool: ConnectionPool | None = None
        # The periodic reads' own connections, apart from the legs'.
        self._fetch_pool: ConnectionPool | None = None
        # Legs under way: a prefill awaiting its answer or a decode stream not yet closed.
        self.open_legs = 0
        # Gaps between reads of every decode stream past its first token, for metrics.
        self.gaps = TokenGaps()

    async def __aenter__(self) -> Self:
        # https:// engines are verified against the system store, or `ca_bundle` if given.
        context = ssl.create_default_context(cafile=self._ca_bundle) if self._ca_bundle else None
        self._pool = ConnectionPool(connect_timeout_s=self.connect_timeout_s, tls=context)
        self._fetch_pool = ConnectionPool(connect_timeout_s=self.connect_timeout_s, tls=context)
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
        if self._fetch_pool is not None:
            self._fetch_pool.close()
            self._fetch_pool = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient is not open; use `async with EngineClient()`")
        return self._session

    async def fetch(self, url: str, timeout_s: float, limit: int = FETCH_LIMIT) -> bytes | None:
        """The body of a GET of `url`, as the periodic reads of each engine's `/metrics` and
        `/v1/models` are sent (on kept connections of their own, apart from the legs');
        None when it answers another status than 200, fails, passes `limit` bytes or takes
        more than `timeout_s`."""
        pool = self._fetch_pool
        if pool is None:
            raise RuntimeError("EngineClient is not open; use `async with EngineClient()`")
        parts = urlsplit(url)
        origin = pool.origin(f"{parts.scheme}://{parts.netloc}")
        path = f"{parts.path}?{parts.query}" if parts.query else parts.path
        connection: Connection | None = None
        try:
            async with clock().timeout(timeout_s):
                connection = await pool.send(origin, get_bytes(path, origin))
                body = await connection.read_all(limit)
        except (TimeoutError, HttpError):
            if connection is not None:
                connection.close()
            return None
        except BaseException:
            if connection is not None:
                connection.close()
            raise
        connection.release()
        return body if connection.status == 200 else None

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

    async def _post_decode(
        self,
        url: str,
        endpoint: str,
        body: bytes,
        request_id: str,
        trace: bytes,
        delivery: Delivery | None,
        engine: str,
    ) -> Connection:
        """Send a decode leg; returns its connection once a 200's head is in. Any other
        status is the engine's error (its connection closed), and `delivery` learns the
        descriptor was refused."""
        connection = await self._post(
            url, endpoint, body, request_id, trace, None if delivery is None else delivery.sent
        )
        if connection.status == 200:
            return connection
        if delivery is not None:
            delivery.refused = True
        try:
            raise await status_error(connection, engine, "decode")
        finally:
            connection.close()

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
        bounds: LegBounds | None = None,
    ) -> PrefillResult:
        """Run the one-token prefill and capture the producer's descriptor.

        With `same_worker`, no blocks are requested: the decode that follows on the same
        engine finds the prompt in its prefix cache. `trace` is the leg's trace context, as
        header lines; `bounds`, its model's (None: the client's own).
        """
        name = engine or producer_url
        timeout_s = (bounds or self.bounds).prefill_timeout_s
        request_id = request_id or new_request_id()
        started_at = asyncio.get_running_loop().time()
        if endpoint == Endpoint.RESPONSES:
            data = responses.prefill_body(
                body, crossed=not same_worker, request_id=responses.response_id(request_id)
            )
        else:
            data = prefill_body(body, crossed=not same_worker)
        self.open_legs += 1
        connection: Connection | None = None
        try:
            async with clock().timeout(timeout_s):
                connection = await self._post(producer_url, endpoint, data, request_id, trace)
                if connection.status != 200:
                    raise await status_error(connection, name, "prefill")
                raw = await connection.read_all(MAX_PREFILL_ANSWER_BYTES)
        except TooLarge:
            raise engine_error(
                Cause.BAD_RESPONSE,
                f"engine {name} answered more than {MAX_PREFILL_ANSWER_BYTES} bytes",
                name,
            ) from None
        except HttpError as exc:
            raise transport_error(exc, name, "prefill") from None
        except TimeoutError:
            raise engine_error(
                Cause.PREFILL_TIMEOUT,
                f"prefill on engine {name} did not answer within {timeout_s:g} s",
                name,
            ) from None
        finally:
            self.open_legs -= 1
            if connection is not None:
                # Back to the pool only when its answer was read to the end.
                connection.release()
        descriptor, prompt_tokens = parse_prefill_answer(
            raw, name, responses=endpoint == Endpoint.RESPONSES
        )
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
        bounds: LegBounds | None = None,
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
            bounds=bounds,
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
        bounds: LegBounds | None = None,
    ) -> DecodeStream:
        """`open_decode` after the handoff check: `descriptor` is what `handoff_descriptor` gave.

        `trace` is the leg's trace context, as header lines; `delivery` learns whether the
        descriptor reached the consumer, on every path; `bounds` are its model's (None: the
        client's own).
        """
        name = engine or consumer_url
        bounds = bounds or self.bounds
        data = decode_body(body, descriptor)
        self.open_legs += 1
        connection: Connection | None = None
        decoder = SseDecoder()
        held: list[SseEvent] = []
        held_bytes = 0
        try:
            async with clock().timeout(bounds.first_token_timeout_s):
                connection = await self._post_decode(
                    consumer_url, endpoint, data, result.request_id, trace, delivery, name
                )
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
                                    bounds.decode_read_timeout_s,
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
                        raise bad_stream(exc, name) from None
        except (HttpError, TimeoutError) as exc:
            self._leg_closed()
            _close(connection)
            raise _before_output(exc, name, connection, bounds) from None
        except BaseException:
            self._leg_closed()
            _close(connection)
            raise

    async def send_whole(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        timeout_s: float = 0.0,
        trace: bytes = b"",
        delivery: Delivery | None = None,
    ) -> WholeAnswer:
        """The decode leg asked for whole (`"stream": false`): the consumer's one answer.

        There is no first token to wait for: the leg, from sending to the answer's last
        byte, is bounded by `timeout_s` (0: by the caller's deadline alone). `delivery`
        learns whether the descriptor reached the consumer, on every path.
        """
        name = engine or consumer_url
        data = whole_decode_body(body, descriptor)
        self.open_legs += 1
        connection: Connection | None = None
        try:
            async with clock().timeout(timeout_s) if timeout_s else _unbounded():
                connection = await self._post_decode(
                    consumer_url, endpoint, data, result.request_id, trace, delivery, name
                )
                raw = await connection.read_all(MAX_WHOLE_ANSWER_BYTES)
        except TooLarge:
            _close(connection)
            connection = None
            raise engine_error(
                Cause.BAD_RESPONSE,
                f"engine {name} answered more than {MAX_WHOLE_ANSWER_BYTES} bytes",
                name,
            ) from None
        except HttpError as exc:
            if connection is None:
                raise transport_error(exc, name, "decode") from None
            raise engine_error(
                Cause.CLOSED_EARLY,
                f"decode answer from engine {name} broke before it ended: {exc}",
                name,
            ) from None
        except TimeoutError:
            raise engine_error(
                Cause.FIRST_TOKEN_TIMEOUT,
                f"engine {name} gave no whole answer within {timeout_s:g} s "
                "(engine.whole_answer_timeout_s)",
                name,
            ) from None
        finally:
            self.open_legs -= 1
            if connection is not None:
                # Back to the pool only when its answer was read to the end; else closed,
                # which aborts the request in the engine.
                connection.release()
        return parse_whole_answer(raw, name)

    async def send_responses(
        self,
        consumer_url: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        rewrite: Mapping[str, Any],
        engine: str | None = None,
        trace: bytes = b"",
        delivery: Delivery | None = None,
        bounds: LegBounds | None = None,
    ) -> ResponsesStream:
        """A Responses decode leg, streamed, up to its first output delta (the first-token
        timeout covers connect, headers and the KV pull, as on the other routes).
        `rewrite`: members the stream sets in the response objects it relays."""
        name = engine or consumer_url
        bounds = bounds or self.bounds
        data = responses.decode_body(
            body, descriptor, request_id=responses.response_id(result.request_id), stream=True
        )
        self.open_legs += 1
        connection: Connection | None = None
        stream: ResponsesStream | None = None
        try:
            async with clock().timeout(bounds.first_token_timeout_s):
                connection = await self._post_decode(
                    consumer_url, Endpoint.RESPONSES, data, result.request_id, trace, delivery, name
                )
                stream = ResponsesStream(
                    connection,
                    name,
                    bounds.decode_read_timeout_s,
                    rewrite=rewrite,
                    on_close=self._leg_closed,
                    gaps=self.gaps,
                )
                await stream.first_output()
                return stream
        except (HttpError, TimeoutError) as exc:
            self._abort(stream, connection)
            raise _before_output(exc, name, connection, bounds) from None
        except BaseException:
            self._abort(stream, connection)
            raise

    def _abort(self, stream: ResponsesStream | None, connection: Connection | None) -> None:
        """A Responses leg that failed before its first output: closed, counted once."""
        if stream is not None:
            stream.close()
        else:
            self._leg_closed()
            _close(connection)

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


def _classify_pre_output(event: SseEvent, engine: str) -> EventKind:
    try:
        decision = classify(event.data)
    except SseError as exc:
        raise bad_stream(exc, engine) from None
    if decision.kind is EventKind.DONE:
        raise engine_error(
            Cause.DONE_BEFORE_TOKEN, "stream ended with [DONE] before any token arrived", engine
        )
    if decision.kind is EventKind.ERROR:
        raise error_object(decision.payload or {}, engine)
    return decision.kind


@contextlib.asynccontextmanager
async def _unbounded() -> AsyncIterator[None]:
    yield


def _before_output(
    exc: HttpError | TimeoutError, engine: str, connection: Connection | None, bounds: LegBounds
) -> NarwhalError:
    """A streamed decode leg that failed before its first output, as the router's error:
    no connection, one broken after its head, or the first-token timeout."""
    if isinstance(exc, TimeoutError):
        return engine_error(
            Cause.FIRST_TOKEN_TIMEOUT,
            f"engine {engine} produced no token within the first-token timeout "
            f"({bounds.first_token_timeout_s:g} s)",
            engine,
        )
    if connection is None:
        return transport_error(exc, engine, "decode")
    return engine_error(
        Cause.CLOSED_EARLY,
        f"decode stream from engine {engine} broke before any token: {exc}",
        engine,
    )


def _close(connection: Connection | None) -> None:
    if connection is not None:
        connection.close()
