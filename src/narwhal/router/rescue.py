"""Stream continuation, the I/O: relay an answer while tracking its ids, and when its consumer
fails after output began, carry it on elsewhere into the same response.

The decisions and shapes are `router.continuation`'s; `Rescue` is also the rules of a
continuation's tries (`router.retry.Tries`, the shared ones `router.replays`'): each replay
goes through the same retry loop as the request's first attempts.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from narwhal.config.continuation import ContinuationConfig
from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.leg_errors import bad_stream
from narwhal.fleet.models import Target
from narwhal.fleet.placement import PromptKey
from narwhal.fleet.table import Fleet, Phase, Reservation
from narwhal.protocol.bodies import ClientRequest, Endpoint
from narwhal.protocol.sse import SseError, block_payloads
from narwhal.router.assemble import Assembler
from narwhal.router.call import Call
from narwhal.router.continuation import (
    ANSWER,
    Head,
    drop_seen,
    merged_usage,
    refusal,
    replay_body,
    rescued_event,
    usage_chunk,
)
from narwhal.router.progress import Progress
from narwhal.router.replays import Replays
from narwhal.router.reply import Reply
from narwhal.router.respond import DONE_EVENT, answer_headers, completion_tokens, stream_headers
from narwhal.router.retry import FirstTries, Retries

# A client that sends this request header with the value `report` learns of continuations:
# an SSE comment in a stream, a response header (`X-Narwhal-Continuations`) otherwise.
REPORT_HEADER = "X-Narwhal-Continuation"
COUNT_HEADER = "X-Narwhal-Continuations"


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class Rescue(Replays):
    """One continuable request from its first relayed byte to its one ending."""

    def __init__(
        self,
        fleet: Fleet,
        retries: Retries,
        reply: Reply,
        call: Call,
        client_request: ClientRequest,
        progress: Progress,
        key: PromptKey | None,
        settings: ContinuationConfig,
        target: Target | None = None,
    ) -> None:
        """`key`: the client prompt's placement key. A replay begins with that prompt, so
        prefix placement prefers the producer expected to hold it in its prefix cache."""
        super().__init__(fleet, retries.outcome, call, key, target, settings)
        self.retries = retries
        self.reply = reply
        self.client_request = client_request
        self.progress = progress
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

    async def serve(self, first: FirstTries) -> None:
        call = self.call
        relayed = await self.retries.run(call, first, self._relay_first)
        while relayed.error is not None:
            error, consumer = relayed.error, relayed.reservation.consumer.id
            if not error.is_engine_fault or error.engine != consumer:
                raise error
            call.cut = True
            self.progress.settle()
            if self.progress.finished:
                # Every token is in; only the usage chunk or [DONE] went missing.
                self.outcome.passed(relayed.reservation, Phase.DECODE)
                return await self._end(None)
            call.attempt_failed(error)
            self.consumer_failed(error, consumer)
            relayed = await self.retries.run(call, self, self._relay_rescued)
        self.outcome.answered(tracked=True)
        return await self._end(relayed.stream)

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
        call = self.call
        call.interruption_s += time.perf_counter() - self.failed_at
        if self.reply.committed and self.report:
            await self.reply.write(
                b": narwhal continued the answer after %d tokens (continuation %d)\n\n"
                % (self.base, call.continuations)
            )
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

    # Continuing: the rules of a continuation's tries (`router.retry.Tries`) ----------

    def next_try(self, call: Call) -> ClientRequest:
        """A fresh prefill of P + G, a fresh handoff and a decode on another consumer, while
        the answer, `continuation.max_attempts` and the continuation budget allow."""
        progress, settings = self.progress, self.settings
        why = refusal(self.client_request, progress, settings.max_tracked_tokens)
        if why is not None:
            raise self._refused(why, ANSWER)
        self.spend(call)
        if not progress.strip:
            self.overhang = progress.ids[progress.committed :]
        progress.ids = progress.generated
        self.base = len(progress.ids)
        body = replay_body(self.client_request, progress)
        return ClientRequest(Endpoint.COMPLETIONS, body, True, False)

    def placed(self, call: Call, reservation: Reservation) -> None:
        super().placed(call, reservation)
        call.replayed_tokens += self.base

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
            headers = answer_headers(call)
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
