"""Stream continuation on the Responses route: a consumer that fails after output began is
replaced mid-answer, the output so far carried into the input.

While a continuable answer is relayed, its events are read for what the client has been
given: the items already done, and the message being written (its id, its place, its text
so far). When the consumer fails, the replay is the same request with that output appended
to the input, the message last and marked `incomplete`, which vLLM continues rather than
answers (`continue_final_message`), with `max_output_tokens` lowered by the deltas already
relayed. Its events are reshaped into the client's response: its lifecycle and `…added`
events dropped, its deltas given the cut message's id and place, every event the next
`sequence_number`, and the done events, the last one's response object and its usage
carrying the whole text.

What continues: an answer cut while writing a message's text (one cut while reasoning, or
while calling a tool, ends as before), of a request without tools, structured output or
log probabilities. Greedy answers continue as one engine would have written them when the
text so far tokenizes to the ids it was generated as (always on the simulator; at a token
that splits a word differently, a real model may go on from the other split).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from narwhal.config.continuation import ContinuationConfig
from narwhal.engines.leg_errors import bad_stream
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.fleet.models import Target
from narwhal.fleet.placement import PromptKey
from narwhal.fleet.table import Fleet, Reservation
from narwhal.protocol.bodies import ClientRequest
from narwhal.protocol.sse import SseDecoder, SseError
from narwhal.router.call import Call
from narwhal.router.continuation import ANSWER
from narwhal.router.replays import Replays
from narwhal.router.reply import Reply
from narwhal.router.respond import answer_headers, stream_headers
from narwhal.router.responses import output_tokens
from narwhal.router.retry import FirstTries, Retries

Keep = Callable[[dict[str, Any], bytes], Awaitable[None]]


def ineligible(body: dict[str, Any]) -> str | None:
    """Why a Responses request may not be continued, or None when it may."""
    if body.get("tools"):
        return "tools"
    text = body.get("text")
    if isinstance(text, dict):
        form = text.get("format")
        if isinstance(form, dict) and form.get("type", "text") != "text":
            return "structured output"
    if body.get("top_logprobs"):
        return "top_logprobs"
    include = body.get("include")
    if isinstance(include, list) and any("logprobs" in str(item) for item in include):
        return "logprobs"
    return None


class Written:
    """What the client has been given of a Responses answer, read from the relayed events."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.sequence_number = -1
        self.done: list[dict[str, Any]] = []
        # The item being written: its `output_item.added` item, and its text so far.
        self.open: dict[str, Any] | None = None
        self.output_index = 0
        self.text: list[str] = []
        self.deltas = 0
        self.bytes = 0
        self._decoder = SseDecoder()

    def note(self, block: bytes, engine: str) -> None:
        try:
            events = self._decoder.feed(block)
        except SseError as exc:
            raise bad_stream(exc, engine) from None
        for event in events:
            self.bytes += len(event.data)
            payload = orjson.loads(event.data)
            self.take(payload)

    def take(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        number = payload.get("sequence_number")
        if type(number) is int:
            self.sequence_number = number
        if kind == "response.created" and self.response is None:
            self.response = payload.get("response")
        elif kind == "response.output_item.added":
            self.open, self.text = payload.get("item"), []
            index = payload.get("output_index")
            self.output_index = index if type(index) is int else len(self.done)
        elif kind == "response.output_item.done":
            item = payload.get("item")
            if isinstance(item, dict):
                self.done.append(item)
            self.open, self.text = None, []
        elif kind == "response.output_text.delta":
            self.deltas += 1
            delta = payload.get("delta")
            if isinstance(delta, str):
                self.text.append(delta)
        elif isinstance(kind, str) and kind.endswith(".delta"):
            self.deltas += 1

    def refusal(self) -> str | None:
        """Why the answer as it stands cannot be continued, or None."""
        item = self.open
        if item is None or item.get("type") != "message":
            return "it was cut outside a message's text (reasoning or a tool call)"
        if not self.text:
            return "its message had no text yet"
        return None

    @property
    def message(self) -> str:
        return "".join(self.text)


class ResponsesRescue(Replays):
    """One continuable Responses request, from its first relayed byte to its one ending;
    also the rules of its replays' tries (`router.retry.Tries`)."""

    def __init__(
        self,
        fleet: Fleet,
        retries: Retries,
        reply: Reply,
        call: Call,
        request: ClientRequest,
        key: PromptKey | None,
        settings: ContinuationConfig,
        target: Target | None,
        keep: Keep,
    ) -> None:
        super().__init__(fleet, retries.outcome, call, key, target, settings)
        self.retries = retries
        self.reply = reply
        self.request = request
        self.keep = keep
        self.written = Written()
        # The response that ends the answer (the last try's, reshaped).
        self.final: dict[str, Any] | None = None
        # Output tokens of the tries before the one relaying now.
        self.tokens_before = 0

    async def serve(self, first: FirstTries) -> None:
        call = self.call
        relayed = await self.retries.run_responses(call, first, self._relay)
        while relayed.error is not None:
            error, consumer = relayed.error, relayed.reservation.consumer.id
            if not error.is_engine_fault or error.engine != consumer:
                raise error
            call.cut = True
            call.attempt_failed(error)
            self.consumer_failed(error, consumer)
            relayed = await self.retries.run_responses(call, self, self._relay_replay)
        self.outcome.answered(tracked=True)

    # The relays ----------------------------------------------------------------------

    async def _relay(self, stream: ResponsesStream) -> None:
        """The first try: events forwarded as they come (streaming), and read."""
        streaming = self.request.stream
        if streaming:
            await self.reply.open_stream(stream_headers(self.call))
        async for data in stream:
            if stream.done:
                response = stream.response
                assert response is not None
                await self._end(response, data if streaming else None)
                return
            self.written.note(data, stream.engine)
            if streaming:
                await self.reply.write(data)
                self.call.sequence_number = stream.sequence_number

    async def _relay_replay(self, stream: ResponsesStream) -> None:
        """A replay: its events reshaped into the client's response."""
        call, written = self.call, self.written
        call.interruption_s += time.perf_counter() - self.failed_at
        item = written.open
        assert item is not None
        cut = _Cut(written.message, item, written.output_index, list(written.done), written.deltas)
        decoder = SseDecoder()
        async for data in stream:
            try:
                events = decoder.feed(data)
            except SseError as exc:
                raise bad_stream(exc, stream.engine) from None
            out: list[bytes] = []
            for event in events:
                payload = orjson.loads(event.data)
                kind = payload.get("type")
                if kind in _ENDS:
                    payload["response"] = self._whole_response(payload.get("response"), cut)
                    payload["sequence_number"] = written.sequence_number + 1
                    last = b"".join(out) + _event(payload)
                    await self._end(payload["response"], last if self.request.stream else None)
                    return
                shaped = self._reshaped(payload, cut)
                if shaped is not None:
                    shaped["sequence_number"] = written.sequence_number + 1
                    written.take(shaped)
                    out.append(_event(shaped))
            if out and self.request.stream:
                await self.reply.write(b"".join(out))
                call.sequence_number = written.sequence_number

    def _reshaped(self, payload: dict[str, Any], cut: _Cut) -> dict[str, Any] | None:
        """A replay's event as the client's response goes on with it; None to drop it."""
        kind = payload.get("type")
        if kind in ("response.created", "response.in_progress"):
            return None
        index = payload.get("output_index")
        # The replay's first item is the cut message, continued.
        first = index == 0
        if first and kind in ("response.output_item.added", "response.content_part.added"):
            return None
        if isinstance(index, int):
            payload["output_index"] = index + cut.output_index
        if not first:
            return payload
        if "item_id" in payload:
            payload["item_id"] = cut.item.get("id")
        if kind == "response.output_text.done":
            payload["text"] = cut.text + str(payload.get("text") or "")
        elif kind == "response.content_part.done":
            part = payload.get("part")
            if isinstance(part, dict):
                part["text"] = cut.text + str(part.get("text") or "")
        elif kind == "response.output_item.done":
            payload["item"] = _whole_item(payload.get("item"), cut)
        return payload

    def _whole_response(self, replayed: object, cut: _Cut) -> dict[str, Any]:
        """The last response object: the original's id and creation, every item, the
        usage of the whole answer."""
        response = dict(replayed) if isinstance(replayed, dict) else {}
        original = self.written.response or {}
        for member in ("id", "created_at", "previous_response_id", "store"):
            if member in original:
                response[member] = original[member]
        output = response.get("output")
        items = output if isinstance(output, list) else []
        if items:
            items = [_whole_item(items[0], cut), *items[1:]]
        response["output"] = [*cut.done, *items]
        usage = response.get("usage")
        if isinstance(usage, dict):
            usage = dict(usage)
            tokens, prompt = usage.get("output_tokens"), usage.get("input_tokens")
            if type(tokens) is int and type(prompt) is int:
                # The replay's input held the text so far, which the answer generated.
                usage["output_tokens"] = tokens + cut.deltas
                usage["input_tokens"] = max(prompt - cut.deltas, 0)
                usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
            response["usage"] = usage
        return response

    async def _end(self, response: dict[str, Any], last: bytes | None) -> None:
        """Keep the response, then the stream's last bytes (or the whole answer)."""
        call = self.call
        encoded = orjson.dumps(response)
        await self.keep(response, encoded)
        call.output_tokens = output_tokens(response)
        call.status = 200
        if last is None:
            await self.reply.answer(200, encoded, answer_headers(call))
        else:
            await self.reply.end(last)

    # The rules of a replay's tries (`router.retry.Tries`) ----------------------------

    def next_try(self, call: Call) -> ClientRequest:
        settings, written = self.settings, self.written
        why = written.refusal()
        if why is None and written.bytes > settings.max_tracked_bytes:
            why = f"its events passed continuation.max_tracked_bytes ({settings.max_tracked_bytes})"
        limit = self.request.max_tokens
        if why is None and limit is not None and limit - written.deltas < 1:
            why = "it had used its max_output_tokens"
        if why is not None:
            raise self._refused(why, ANSWER)
        self.spend(call)
        body = dict(self.request.body)
        item = written.open
        assert item is not None
        partial = {
            "type": "message",
            "role": "assistant",
            "id": item.get("id"),
            "status": "incomplete",
            "content": [{"type": "output_text", "text": written.message, "annotations": []}],
        }
        sent = body["input"]
        whole = (
            [{"type": "message", "role": "user", "content": sent}]
            if isinstance(sent, str)
            else list(sent)
        )
        body["input"] = [*whole, *written.done, partial]
        if limit is not None:
            body["max_output_tokens"] = limit - written.deltas
        return ClientRequest(self.request.endpoint, body, True, False, self.request.ask)

    def placed(self, call: Call, reservation: Reservation) -> None:
        super().placed(call, reservation)
        call.replayed_tokens += self.written.deltas


_ENDS = frozenset({"response.completed", "response.incomplete"})


class _Cut:
    """Where the answer was cut: the message's text so far, the message, its place, the
    items done before it, and the deltas relayed."""

    __slots__ = ("deltas", "done", "item", "output_index", "text")

    def __init__(
        self,
        text: str,
        item: dict[str, Any],
        output_index: int,
        done: list[dict[str, Any]],
        deltas: int,
    ) -> None:
        self.text = text
        self.item = item
        self.output_index = output_index
        self.done = done
        self.deltas = deltas


def _whole_item(replayed: object, cut: _Cut) -> dict[str, Any]:
    """The cut message with the whole text: its own id, the replay's status and text."""
    whole = dict(replayed) if isinstance(replayed, dict) else {}
    whole["id"] = cut.item.get("id")
    content = whole.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        first = dict(content[0])
        first["text"] = cut.text + str(first.get("text") or "")
        whole["content"] = [first, *content[1:]]
    return whole


def _event(payload: dict[str, Any]) -> bytes:
    kind = str(payload.get("type")).encode()
    return b"event: " + kind + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
