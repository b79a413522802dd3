"""Where a request's tokens go: an SSE stream, or one JSON object at the end.

The engine drives both through the same calls, so the request path is written once; each
output decides what a call means for its transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import orjson
from aiohttp import web

from narwhal.sim.api import ApiError, InferenceRequest
from narwhal.sim.model import Generation
from narwhal.sim.responses import DONE, StreamEncoder, completion, event


class Output(Protocol):
    streaming: bool

    async def open(self) -> None:
        """Send what goes out before any work (a stream's 200 headers)."""

    async def begin(self) -> None:
        """Mark the start of generated output (a chat stream's role chunk)."""

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        """Relay text released by consecutive tokens; the last may finish the generation."""

    async def metadata(self) -> None:
        """Show liveness without output."""

    async def done_early(self) -> web.StreamResponse:
        """End the stream with [DONE] before any token."""

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """End the request with an error."""

    async def finish(
        self, generation: Generation, extra: Mapping[str, object]
    ) -> web.StreamResponse:
        """End the request normally; `extra` adds top-level fields to a JSON answer."""

    def abort(self) -> web.StreamResponse:
        """Cut the connection without a proper ending."""


def error_response(error: ApiError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


class SseOutput:
    """A `text/event-stream` response; several events may share one transport write."""

    streaming = True

    def __init__(
        self, request: web.Request, inference: InferenceRequest, encoder: StreamEncoder
    ) -> None:
        self._request = request
        self._inference = inference
        self._encoder = encoder
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self._response.prepare(self._request)

    async def begin(self) -> None:
        if self._inference.route == "chat":
            await self._response.write(self._encoder.role())

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        token = self._encoder.token
        parts = [token(text) for text in texts[:-1] if text]
        last = texts[-1]
        if generation.finish_reason is not None:
            parts.append(self._encoder.last_token(last, generation.finish_reason))
        elif last:
            parts.append(token(last))
        if parts:
            await self._response.write(b"".join(parts))

    async def metadata(self) -> None:
        await self._response.write(self._encoder.metadata())

    async def done_early(self) -> web.StreamResponse:
        await self._response.write(DONE)
        await self._response.write_eof()
        return self._response

    async def fail(self, error: ApiError) -> web.StreamResponse:
        await self._response.write(event(error.to_json()) + DONE)
        await self._response.write_eof()
        return self._response

    async def finish(
        self, generation: Generation, extra: Mapping[str, object]
    ) -> web.StreamResponse:
        tail = DONE
        if self._inference.include_usage:
            prompt_tokens = len(self._inference.prompt_tokens)
            tail = self._encoder.usage(prompt_tokens, generation.completion_tokens) + DONE
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
    ) -> None:
        self._request = request
        self._inference = inference
        self._response_id = response_id
        self._created = created
        self._model = model

    async def open(self) -> None:
        pass

    async def begin(self) -> None:
        pass

    async def tokens(self, texts: list[str], generation: Generation) -> None:
        pass

    async def metadata(self) -> None:
        pass

    async def done_early(self) -> web.StreamResponse:
        raise NotImplementedError("only a stream can end before its first token")

    async def fail(self, error: ApiError) -> web.StreamResponse:
        return error_response(error)

    async def finish(
        self, generation: Generation, extra: Mapping[str, object]
    ) -> web.StreamResponse:
        assert generation.finish_reason is not None
        body = completion(
            self._inference.route,
            self._response_id,
            self._created,
            self._model,
            text=generation.text,
            finish_reason=generation.finish_reason,
            prompt_tokens=len(self._inference.prompt_tokens),
            completion_tokens=generation.completion_tokens,
        )
        body.update(extra)
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def abort(self) -> web.StreamResponse:
        _abort(self._request)
        return web.Response()
