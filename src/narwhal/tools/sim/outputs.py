"""Where a request's tokens go: an SSE stream, or one JSON object at the end.

The engine drives both through the same calls, so the request path is written once; each
output decides what a call means for its transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import orjson
from aiohttp import web

from narwhal.tools.sim.api import ApiError, InferenceRequest
from narwhal.tools.sim.model import Generation
from narwhal.tools.sim.responses import (
    DONE,
    KEEP_ALIVE,
    Answer,
    StreamEncoder,
    Usage,
    completion,
    event,
)


class Output(Protocol):
    streaming: bool

    async def open(self) -> None:
        """Send what goes out before any work (a stream's 200 headers)."""

    async def begin(self) -> None:
        """Mark the start of generated output (a chat stream's role chunk)."""

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        """Relay consecutive tokens, each with the text it released (maybe none); the
        last may finish the generation."""

    async def keep_alive(self) -> None:
        """Show liveness without output."""

    async def done_early(self) -> web.StreamResponse:
        """End the stream with [DONE] before any token."""

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """End the request with an error."""

    async def finish(
        self,
        generation: Generation,
        usage: Usage,
        kv_transfer_params: Mapping[str, object] | None,
    ) -> web.StreamResponse:
        """End the request normally; a JSON answer carries `kv_transfer_params`."""

    def abort(self) -> web.StreamResponse:
        """Cut the connection without a proper ending."""


def error_response(error: ApiError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


class SseOutput:
    """A `text/event-stream` response; several events may share one transport write.

    Like vLLM, one event per generated token, whatever text it released; with a
    reasoning parser (`reasoning_tokens`), a chat stream's first tokens are reasoning.
    """

    streaming = True

    def __init__(
        self,
        request: web.Request,
        inference: InferenceRequest,
        encoder: StreamEncoder,
        reasoning_tokens: int = 0,
    ) -> None:
        self._request = request
        self._inference = inference
        self._encoder = encoder
        self._reasoning_tokens = reasoning_tokens if inference.route == "chat" else 0
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self._response.prepare(self._request)

    async def begin(self) -> None:
        if self._inference.route == "chat":
            await self._response.write(self._encoder.role())

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        first = generation.completion_tokens - len(texts)
        reasoning = self._reasoning_tokens
        token = self._encoder.token
        last = len(texts) - 1
        finished = generation.finish_reason is not None
        plain = texts[:last] if finished else texts
        # Token ids are encoded only when the request asked for them (`return_token_ids`).
        ids = generation.token_ids if self._inference.return_token_ids else None
        if ids is None:
            parts = [token(text, reasoning=first + i < reasoning) for i, text in enumerate(plain)]
        else:
            parts = [
                token(text, reasoning=first + i < reasoning, token_id=ids[first + i])
                for i, text in enumerate(plain)
            ]
        if finished:
            assert generation.finish_reason is not None
            parts.append(
                self._encoder.last_token(
                    texts[-1],
                    generation.finish_reason,
                    generation.stop_reason,
                    reasoning=first + last < reasoning,
                    with_fingerprint=not self._inference.include_usage,
                    token_id=0 if ids is None else ids[first + last],
                )
            )
        await self._response.write(b"".join(parts))

    async def keep_alive(self) -> None:
        await self._response.write(KEEP_ALIVE)

    async def done_early(self) -> web.StreamResponse:
        await self._response.write(DONE)
        await self._response.write_eof()
        return self._response

    async def fail(self, error: ApiError) -> web.StreamResponse:
        await self._response.write(event(error.to_json()) + DONE)
        await self._response.write_eof()
        return self._response

    async def finish(
        self,
        generation: Generation,
        usage: Usage,
        kv_transfer_params: Mapping[str, object] | None,
    ) -> web.StreamResponse:
        tail = DONE
        if self._inference.include_usage:
            tail = self._encoder.usage(usage) + DONE
        await self._response.write(tail)
        await self._response.write_eof()
        return self._response

    def abort(self) -> web.StreamResponse:
        _abort(self._request)
        return self._response


class JsonOutput:
    """A non-streaming request: nothing is sent until the generation ends."""

    streaming = False

    def __init__(
        self,
        request: web.Request,
        inference: InferenceRequest,
        response_id: str,
        created: int,
        model: str,
        *,
        fingerprint: str,
        reasoning_tokens: int = 0,
        reasoning_field: str = "reasoning",
    ) -> None:
        self._request = request
        self._inference = inference
        self._response_id = response_id
        self._created = created
        self._model = model
        self._fingerprint = fingerprint
        self._reasoning_field = reasoning_field
        self._reasoning_tokens = reasoning_tokens if inference.route == "chat" else 0
        self._reasoning: list[str] = []
        self._content: list[str] = []

    async def open(self) -> None:
        pass

    async def begin(self) -> None:
        pass

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        first = generation.completion_tokens - len(texts)
        for index, text in enumerate(texts, first):
            (self._reasoning if index < self._reasoning_tokens else self._content).append(text)

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
        assert generation.finish_reason is not None
        answer = Answer(
            text="".join(self._content),
            finish_reason=generation.finish_reason,
            stop_reason=generation.stop_reason,
            usage=usage,
            reasoning="".join(self._reasoning) if self._reasoning_tokens else None,
            prompt_token_ids=(
                self._inference.prompt_tokens if self._inference.return_token_ids else None
            ),
            token_ids=generation.token_ids if self._inference.return_token_ids else None,
        )
        route = self._inference.route
        assert route != "responses", "a Responses request has its own outputs"
        body = completion(
            route,
            self._response_id,
            self._created,
            self._model,
            answer,
            fingerprint=self._fingerprint,
            reasoning_field=self._reasoning_field,
            kv_transfer_params=kv_transfer_params,
        )
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def abort(self) -> web.StreamResponse:
        _abort(self._request)
        return web.Response()
