"""The Responses API's answers as vLLM 0.32 sends them: the response object, and the events
of a streamed response, member for member.

A stream opens with `response.created` and `response.in_progress` (the response with no
output yet), sent before the engine schedules the request. The first token that releases
text adds the message (`response.output_item.added`, `response.content_part.added`); each
such token is one `response.output_text.delta` (a token that releases no text sends
nothing). At the end come `response.output_text.done`, `response.content_part.done` and
`response.output_item.done` (only if a message was added), then `response.completed` with
the whole response: status `incomplete` when generation stopped on its length cap, output,
usage and a prefill's `kv_transfer_params`. Events are `event: <type>` and `data: <json>`
lines, `sequence_number` counts them from 0, and no `[DONE]` follows.

vLLM 0.32 has no error event on this route: an error during a stream (a failed KV load)
fails to serialize as an event, and the connection is closed with the chunked body unended.
Nor does it send SSE keep-alive comments here.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import orjson
from aiohttp import web

from narwhal.tools.sim.api import ApiError, InferenceRequest
from narwhal.tools.sim.model import Generation
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.outputs import error_response
from narwhal.tools.sim.prompt import Prompt, cache_write_tokens, reported_cached_tokens
from narwhal.tools.sim.responses import Usage
from narwhal.tools.sim.responses_api import ResponsesCall

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
_DELTA = b"response.output_text.delta"


def new_item_id() -> str:
    """An output message's id as vLLM 0.32 makes one: `msg_` and 16 hex digits."""
    return "msg_" + secrets.token_hex(8)


def responses_usage(
    options: SimOptions, inference: InferenceRequest, generation: Generation, prompt: Prompt
) -> Usage:
    """A Responses request's counts: unlike the chat route's usage, the cached prompt tokens
    are always reported, with the tokens newly written to the prefix cache; no reasoning
    parser is modelled on this route, so no reasoning tokens."""
    return Usage(
        len(inference.prompt_tokens),
        generation.completion_tokens,
        cached_tokens=reported_cached_tokens(inference, prompt),
        reasoning_tokens=0,
        cache_write_tokens=cache_write_tokens(options, prompt),
    )


def usage_object(usage: Usage) -> dict[str, object]:
    """The response's `usage`: one turn, so the per-turn lists stay empty (as vLLM 0.32's)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens or 0,
            "cache_write_tokens": usage.cache_write_tokens or 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens or 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def text_part(text: str, logprobs: list[object] | None) -> dict[str, object]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, content: list[object], status: str) -> dict[str, object]:
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_object(
    call: ResponsesCall,
    created: int,
    *,
    status: str,
    output: list[object],
    usage: Usage | None,
    kv_transfer_params: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The response, every member vLLM 0.32 dumps, in its order; its id is the request's."""
    echo = call.echo
    body: dict[str, object] = {
        "id": call.request_id,
        "created_at": created,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": echo["instructions"],
        "metadata": echo["metadata"],
        "model": call.inference.model,
        "object": "response",
        "output": output,
    }
    for name in (
        "parallel_tool_calls",
        "temperature",
        "tool_choice",
        "tools",
        "top_p",
        "background",
        "max_output_tokens",
        "max_tool_calls",
        "previous_response_id",
        "prompt",
        "reasoning",
        "service_tier",
    ):
        body[name] = echo[name]
    body["status"] = status
    body.update(text=echo["text"], top_logprobs=echo["top_logprobs"])
    body.update(truncation=echo["truncation"], usage=None if usage is None else usage_object(usage))
    for name in ("user", "presence_penalty", "frequency_penalty"):
        body[name] = echo[name]
    body.update(
        kv_transfer_params=None if kv_transfer_params is None else dict(kv_transfer_params),
        ec_transfer_params=None,
        input_messages=None,
        output_messages=None,
    )
    return body


def finished_status(generation: Generation) -> str:
    """`incomplete` when the length cap (`max_output_tokens`) stopped it, else `completed`."""
    return "incomplete" if generation.finish_reason == "length" else "completed"


def responses_output(
    request: web.Request, call: ResponsesCall, created: int
) -> ResponsesSseOutput | ResponsesJsonOutput:
    """The output a Responses request is answered through."""
    if call.inference.stream:
        return ResponsesSseOutput(request, call, created)
    return ResponsesJsonOutput(request, call, created)


class ResponsesSseOutput:
    """A streamed response: vLLM 0.32's event sequence, one delta per token with text."""

    streaming = True

    def __init__(self, request: web.Request, call: ResponsesCall, created: int) -> None:
        self._request = request
        self._call = call
        self._created = created
        self._sequence = 0
        self._item_id = new_item_id()
        self._texts: list[str] = []
        self._response = web.StreamResponse(headers=_SSE_HEADERS)
        # A delta differs from the next only in its text and number: the rest is encoded once.
        self._delta_head = b"event: " + _DELTA + b'\ndata: {"content_index":0,"delta":'
        self._delta_middle = (
            b',"item_id":'
            + orjson.dumps(self._item_id)
            + b',"logprobs":[],"output_index":0,"sequence_number":'
        )

    def _event(self, kind: str, members: Mapping[str, object]) -> bytes:
        """One event; its members in alphabetical order, as the openai models define them."""
        payload = dict(members, sequence_number=self._sequence, type=kind)
        self._sequence += 1
        data = orjson.dumps(dict(sorted(payload.items())))
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _delta(self, text: str) -> bytes:
        number = self._sequence
        self._sequence += 1
        return (
            self._delta_head
            + orjson.dumps(text)
            + self._delta_middle
            + b'%d,"type":"%s"}\n\n' % (number, _DELTA)
        )

    async def open(self) -> None:
        await self._response.prepare(self._request)
        initial = response_object(
            self._call, self._created, status="in_progress", output=[], usage=None
        )
        await self._response.write(
            self._event("response.created", {"response": initial})
            + self._event("response.in_progress", {"response": initial})
        )

    async def begin(self) -> None:
        pass  # the message is added with its first text

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        events: list[bytes] = []
        for text in texts:
            if not text:
                continue
            if not self._texts:
                events.append(
                    self._event(
                        "response.output_item.added",
                        {
                            "item": message_item(self._item_id, [], "in_progress"),
                            "output_index": 0,
                        },
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        {
                            "content_index": 0,
                            "item_id": self._item_id,
                            "output_index": 0,
                            "part": text_part("", []),
                        },
                    )
                )
            self._texts.append(text)
            events.append(self._delta(text))
        if events:
            await self._response.write(b"".join(events))

    async def keep_alive(self) -> None:
        pass  # vLLM 0.32 sends no keep-alive comments on this route

    async def done_early(self) -> web.StreamResponse:
        """The response completes with no output: created, in progress, completed."""
        usage = Usage(len(self._call.inference.prompt_tokens), 0, 0, 0, 0)
        final = response_object(
            self._call, self._created, status="completed", output=[], usage=usage
        )
        await self._response.write(self._event("response.completed", {"response": final}))
        await self._response.write_eof()
        return self._response

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """As vLLM 0.32: no event for the error, the connection closed mid-body."""
        if self._request.transport is not None:
            self._request.transport.close()
        return self._response

    async def finish(
        self,
        generation: Generation,
        usage: Usage,
        kv_transfer_params: Mapping[str, object] | None,
    ) -> web.StreamResponse:
        events: list[bytes] = []
        output: list[object] = []
        if self._texts:
            text = "".join(self._texts)
            part = text_part(text, None)
            item = message_item(self._item_id, [part], "completed")
            where = {"content_index": 0, "item_id": self._item_id, "output_index": 0}
            events.append(
                self._event("response.output_text.done", where | {"logprobs": [], "text": text})
            )
            events.append(self._event("response.content_part.done", where | {"part": part}))
            events.append(
                self._event("response.output_item.done", {"item": item, "output_index": 0})
            )
            output.append(item)
        final = response_object(
            self._call,
            self._created,
            status=finished_status(generation),
            output=output,
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )
        events.append(self._event("response.completed", {"response": final}))
        await self._response.write(b"".join(events))
        await self._response.write_eof()
        return self._response

    def abort(self) -> web.StreamResponse:
        if self._request.transport is not None:
            self._request.transport.abort()
        return self._response


class ResponsesJsonOutput:
    """A response answered whole: nothing is sent until the generation ends."""

    streaming = False

    def __init__(self, request: web.Request, call: ResponsesCall, created: int) -> None:
        self._request = request
        self._call = call
        self._created = created
        self._texts: list[str] = []

    async def open(self) -> None:
        pass

    async def begin(self) -> None:
        pass

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        self._texts += texts

    async def keep_alive(self) -> None:
        pass

    async def done_early(self) -> web.StreamResponse:
        raise NotImplementedError("only a stream can end before its first token")

    async def fail(self, error: ApiError) -> web.StreamResponse:
        return error_response(error)

    async def finish(
        self,
        generation: Generation,
        usage: Usage,
        kv_transfer_params: Mapping[str, object] | None,
    ) -> web.StreamResponse:
        text = "".join(self._texts)
        # Unlike a streamed response's, the message is there even with no text.
        content: list[object] = [text_part(text, None)] if text else []
        body = response_object(
            self._call,
            self._created,
            status=finished_status(generation),
            output=[message_item(new_item_id(), content, "completed")],
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def abort(self) -> web.StreamResponse:
        if self._request.transport is not None:
            self._request.transport.abort()
        return web.Response()
