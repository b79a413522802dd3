"""Stream continuation, the I/O: relay an answer while tracking its ids, and when its consumer
fails after output began, carry it on elsewhere into the same response.

The decisions and shapes are `router.continuation`'s; this module places the replay, sends
its legs through the router's own attempt path and writes what the client gets.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.leg_errors import bad_stream
from narwhal.fleet.table import Reservation
from narwhal.protocol.bodies import ClientRequest, Endpoint
from narwhal.protocol.errors import NarwhalError
from narwhal.protocol.sse import SseError, block_payloads
from narwhal.router.assemble import Assembler
from narwhal.router.call import Call, Stage
from narwhal.router.continuation import (
    ANSWER,
    BUDGET,
    FLEET,
    Head,
    drop_seen,
    merged_usage,
    refusal,
    replay_body,
    rescued_event,
    usage_chunk,
)
from narwhal.router.progress import Progress
from narwhal.router.reply import Reply
from narwhal.router.respond import DONE_EVENT, completion_tokens, stream_headers

if TYPE_CHECKING:
    from narwhal.router.pipeline import Router

# A client that sends this request header with the value `report` learns of continuations:
# an SSE comment in a stream, a response header (`X-Narwhal-Continuations`) otherwise.
REPORT_HEADER = "X-Narwhal-Continuation"
COUNT_HEADER = "X-Narwhal-Continuations"


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class Rescue:
    """One continuable request from its first relayed byte to its one ending."""

    def __init__(
        self,
        router: Router,
        reply: Reply,
        call: Call,
        client_request: ClientRequest,
        progress: Progress,
    ) -> None:
        self.router = router
        self.reply = reply
        self.call = call
        self.client_request = client_request
        self.progress = progress
        self.settings = router.config.continuation
        self.report = (reply.header(REPORT_HEADER) or "").lower() == "report"
        self.assembler = None if client_request.stream else Assembler(call.endpoint)
        self.head: Head | None = None
        # Generated ids the current replay's prompt already holds (0 before any).
        self.base = 0
        self.usage: dict[str, Any] | None = None
        self.fingerprint: object | None = None
        # Ids the client asked for and was given past the committed boundary (tokens whose
        # text was held): the replay generates them again, and the client gets them once.
        self.overhang: list[int] = []

    async def serve(self, reservation: Reservation, stream: DecodeStream) -> None:
        failed_consumers: set[str] = set()
        avoid: set[str] = set()
        rescued = False
        while True:
            try:
                try:
                    async with stream:
                        self.call.enter(Stage.RELAY)
                        if rescued:
                            await self._relay_rescued(stream)
                        else:
                            await self._relay_first(stream)
                finally:
                    reservation.release()
            except NarwhalError as error:
                self.router._blame(error, reservation)
                consumer = reservation.consumer.id
                if not error.is_engine_fault or error.engine != consumer:
                    raise
                self.call.cut = True
                self.progress.settle()
                if self.progress.finished:
                    # Every token is in; only the usage chunk or [DONE] went missing.
                    self.router.breaker.success(consumer)
                    return await self._end(None)
                self.call.attempt_failed(error)
                failed_consumers.add(consumer)
                avoid.add(consumer)
                reservation, stream = await self._resume(error, failed_consumers, avoid)
                rescued = True
                continue
            self.router.breaker.success(reservation.consumer.id)
            self.router.budget.on_success()
            self.router.continuation_budget.on_success()
            return await self._end(stream)

    # The relays ----------------------------------------------------------------------

    async def _commit(self) -> Reply:
        reply = self.reply
        if not reply.committed:
            await reply.open_stream(stream_headers(self.call))
        return reply

    async def _relay_first(self, stream: DecodeStream) -> None:
        """The original decode: engine bytes forwarded, ids recorded (and spliced out)."""
        take = self.progress.take
        if self.assembler is None:
            response = await self._commit()
            async for data in stream:
                await response.write(take(data))
        else:
            assembler = self.assembler
            async for data in stream:
                for payload in _payloads(take(data), stream.engine):
                    assembler.add(payload)
        self.usage = stream.usage
        if self.assembler is not None and stream.usage_chunk is not None:
            self.assembler.add(stream.usage_chunk)

    async def _relay_rescued(self, stream: DecodeStream) -> None:
        """A replay's events, reshaped into the client's answer (its id, its format)."""
        head = self._head()
        chat = self.call.endpoint is Endpoint.CHAT
        keep_ids = not self.progress.strip
        response = await self._commit() if self.assembler is None else None
        async for data in stream:
            parts: list[bytes] = []
            for payload in _payloads(data, stream.engine):
                chunk, choice, text = rescued_event(payload, head, chat=chat, keep_ids=keep_ids)
                if choice is None:
                    continue
                self.progress.note_payload(choice, text)
                if self.overhang:
                    self.overhang = drop_seen(chunk, self.overhang)
                if self.assembler is not None:
                    self.assembler.add(chunk)
                else:
                    parts.append(_sse(chunk))
            if response is not None and parts:
                await response.write(b"".join(parts))
        prompt = len(self.progress.prompt_ids or ())
        self.usage = merged_usage(prompt, self.base, stream.usage)
        if stream.usage_chunk is not None:
            self.fingerprint = stream.usage_chunk.get("system_fingerprint")

    def _head(self) -> Head:
        if self.head is None:
            first = self.progress.first_event or b""
            try:
                payloads = block_payloads(first)
            except SseError:
                payloads = []
            self.head = Head.of(payloads[0] if payloads else {})
        return self.head

    # Continuing ----------------------------------------------------------------------

    async def _resume(
        self, error: NarwhalError, failed_consumers: set[str], avoid: set[str]
    ) -> tuple[Reservation, DecodeStream]:
        """A fresh prefill of P + G, a fresh handoff and a decode on another consumer."""
        router, call, progress = self.router, self.call, self.progress
        started = time.perf_counter()
        # Placed by the client's own prompt: the replay begins with it, so prefix placement
        # prefers the producer expected to hold it in its prefix cache.
        key = router.fleet.placer.key(self.client_request.body)
        while True:
            why = refusal(self.client_request, progress, self.settings.max_tracked_tokens)
            if why is not None:
                raise self._refused(error, why, ANSWER)
            if call.continuations >= self.settings.max_attempts:
                why = f"continuation.max_attempts ({self.settings.max_attempts}) used"
                raise self._refused(error, why, BUDGET)
            if not router.continuation_budget.try_spend():
                why = "the router's continuation budget (continuation.budget) is spent"
                raise self._refused(error, why, BUDGET)
            if not progress.strip:
                self.overhang = progress.ids[progress.committed :]
            progress.ids = progress.generated
            self.base = len(progress.ids)
            replay = ClientRequest(
                Endpoint.COMPLETIONS, replay_body(self.client_request, progress), True, False
            )
            call.enter(Stage.QUEUED)
            try:
                reservation = await router.fleet.reserve(frozenset(avoid), key)
            except NarwhalError as unplaced:
                why = f"no consumer was placed: {unplaced.message}"
                raise self._refused(error, why, FLEET) from None
            if reservation.consumer.id in failed_consumers:
                reservation.release()
                raise self._refused(error, "no other consumer is available to continue on", FLEET)
            call.continuations += 1
            call.replayed_tokens += self.base
            try:
                stream = await router._attempt(call, replay, reservation, rescue=True)
            except NarwhalError as failed:
                reservation.release()
                call.attempt_failed(failed)
                router._blame(failed, reservation)
                if failed.engine is not None:
                    avoid.add(failed.engine)
                    if failed.engine == reservation.consumer.id:
                        failed_consumers.add(failed.engine)
                error = failed
                continue
            except BaseException:
                reservation.release()
                raise
            call.interruption_s += time.perf_counter() - started
            if self.reply.committed and self.report:
                await self.reply.write(
                    b": narwhal continued the answer after %d tokens (continuation %d)\n\n"
                    % (self.base, call.continuations)
                )
            return reservation, stream

    def _refused(self, error: NarwhalError, why: str, kind: str) -> NarwhalError:
        self.call.continuation_refused, self.call.refused_kind = why, kind
        return NarwhalError(
            error.status,
            f"{error.message}; the answer was not continued: {why}",
            error.cause,
            transient=error.transient,
            engine=error.engine,
        )

    # The end -------------------------------------------------------------------------

    async def _end(self, stream: DecodeStream | None) -> None:
        call, progress = self.call, self.progress
        usage = self.usage
        if usage is None or stream is None:
            # The answer's ids are all in, but its usage went missing with its engine.
            prompt = len(progress.prompt_ids or ())
            usage = merged_usage(prompt, len(progress.ids), None)
        call.output_tokens = completion_tokens(usage)
        call.status = 200
        if self.assembler is not None:
            self.assembler.usage = usage
            headers = {"X-Request-Id": call.request_id}
            if self.report:
                headers[COUNT_HEADER] = str(call.continuations)
            await self.reply.answer(200, orjson.dumps(self.assembler.result()), headers)
            return
        response = await self._commit()
        tail = DONE_EVENT
        rescued = call.continuations > 0 or stream is None
        if rescued and self.client_request.include_usage:
            tail = _sse(usage_chunk(self._head(), usage, self.fingerprint)) + DONE_EVENT
        await response.end(tail)


def _payloads(block: bytes, engine: str) -> list[dict[str, Any]]:
    try:
        return block_payloads(block)
    except SseError as exc:
        raise bad_stream(exc, engine) from None
