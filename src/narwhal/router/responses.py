"""The Responses route's own part of a request: the conversation it follows, rebuilt for
whichever engines it is placed on, and the response it makes, kept once it is answered.

The engines never keep a response (`store: false` on both legs): the router does, in its
conversation store (`[responses]`, `narwhal.conversations`). A follow-up names the response
it continues (`previous_response_id`); its engines get the whole conversation as input,
every earlier turn's input and output items in order, then its own. The store is opened on
the route's first use, so a router whose clients never call it pays nothing for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

import orjson

from narwhal.config.responses import ResponsesConfig, StoreKind
from narwhal.conversations.record import ConversationStore, NotStored, StoredResponse
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.protocol.bodies import ClientRequest
from narwhal.protocol.errors import Cause, NarwhalError, client_error
from narwhal.protocol.responses import conversation_input, engine_body
from narwhal.router.call import Call
from narwhal.router.reply import Reply
from narwhal.router.respond import answer_headers, stream_headers

log = logging.getLogger("narwhal.responses")

# How often stored responses past their retention are removed.
PRUNE_INTERVAL_S = 60.0

Opener = Callable[[ResponsesConfig], Awaitable[ConversationStore | None]]
Spawn = Callable[[Coroutine[Any, Any, None], str], object]


def not_found(response_id: str, param: str) -> NarwhalError:
    """The 404 for a response the store does not hold (or holds for another tenant)."""
    return NarwhalError(
        404,
        f"no response with id '{response_id}' is stored",
        Cause.BAD_REQUEST,
        param=param,
    )


class Conversations:
    """The conversation store as the request path and the read routes use it."""

    def __init__(self, config: ResponsesConfig, opener: Opener, spawn: Spawn) -> None:
        self.config = config
        self._opener = opener
        self._spawn = spawn
        self._store: ConversationStore | None = None
        self._opened = False
        self._lock = asyncio.Lock()

    async def store(self) -> ConversationStore | None:
        """The store, opened on first use; None when `store = "off"`. A store that cannot
        be opened is a 503 naming it (and is tried again by the next request)."""
        if self._opened:
            return self._store
        async with self._lock:
            if not self._opened:
                try:
                    self._store = await self._opener(self.config)
                except Exception as exc:
                    where = (
                        self.config.redis_url
                        if self.config.store is StoreKind.REDIS
                        else self.config.path
                    )
                    log.error("the response store at %s could not be opened: %s", where, exc)
                    raise NarwhalError(
                        503,
                        f"the response store is unavailable: {exc}",
                        Cause.UNAVAILABLE,
                        retry_after=1,
                    ) from None
                self._opened = True
                if self._store is not None:
                    self._spawn(self._prune(self._store), "responses-retention")
        return self._store

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def _prune(self, store: ConversationStore) -> None:
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_S)
            try:
                removed = await store.prune()
            except Exception:
                log.exception("pruning stored responses failed")
                continue
            if removed:
                log.info("removed %d stored responses past their retention", removed)

    # The request path ------------------------------------------------------------------

    async def engine_request(
        self, call: Call, request: ClientRequest
    ) -> tuple[ClientRequest, tuple[str, ...]]:
        """The request as the engines get it (the whole conversation as input, nothing
        stored there), and the ids of the responses it follows, oldest first."""
        ask = request.ask
        assert ask is not None
        if ask.previous_response_id is None:
            if ask.store:
                # A store that cannot be opened is its 503 before any engine works.
                await self.store()
            body = engine_body(request.body, request.body["input"])
            return replace(request, body=body), ()
        store = await self.store()
        previous = ask.previous_response_id
        if store is None:
            raise not_found(previous, "previous_response_id")
        try:
            turns = await store.conversation(previous, call.tenant)
        except NotStored as missing:
            if missing.response_id == previous:
                raise not_found(previous, "previous_response_id") from None
            raise NarwhalError(
                404,
                f"the conversation of response '{previous}' is no longer whole: its earlier "
                f"response '{missing.response_id}' is not stored",
                Cause.BAD_REQUEST,
                param="previous_response_id",
            ) from None
        whole = conversation_input([_turn(turn) for turn in turns], ask.items)
        return replace(request, body=engine_body(request.body, whole)), tuple(
            turn.id for turn in turns
        )

    async def keep(
        self,
        call: Call,
        request: ClientRequest,
        ancestors: tuple[str, ...],
        response: dict[str, Any],
        encoded: bytes,
    ) -> None:
        """Keep the response, when its request asked to (before the client gets its end:
        a response the client was told of can be continued from)."""
        ask = request.ask
        assert ask is not None
        if not ask.store:
            return
        store = await self.store()
        if store is None:
            return
        response_id = response.get("id")
        if not isinstance(response_id, str) or not response_id:
            raise NarwhalError(
                502,
                f"engine {call.consumer} answered a response without an id; it was not stored",
                Cause.BAD_RESPONSE,
            )
        record = StoredResponse(
            id=response_id,
            tenant=call.tenant,
            model=str(response.get("model") or call.model or ""),
            created_at=time.time(),
            previous_id=ask.previous_response_id,
            ancestors=ancestors,
            input=orjson.dumps(ask.items),
            response=encoded,
        )
        try:
            await store.put(record)
        except Exception as exc:
            log.error("response %s could not be stored: %s", response_id, exc)
            raise NarwhalError(
                503,
                f"the response could not be stored: {exc}",
                Cause.UNAVAILABLE,
                retry_after=1,
            ) from None

    # The read routes -------------------------------------------------------------------

    async def read(self, response_id: str, tenant: str | None) -> StoredResponse:
        store = await self.store()
        record = None if store is None else await store.get(response_id, tenant)
        if record is None:
            raise not_found(response_id, "response_id")
        return record

    async def delete(self, response_id: str, tenant: str | None) -> None:
        store = await self.store()
        if store is None or not await store.delete(response_id, tenant):
            raise not_found(response_id, "response_id")


def _turn(record: StoredResponse) -> tuple[list[Any], list[Any]]:
    """A stored turn as input: its own input items, then its output items."""
    items = orjson.loads(record.input)
    output = orjson.loads(record.response).get("output")
    return items, output if isinstance(output, list) else []


def input_items_page(record: StoredResponse, query: dict[str, str]) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the response's own input items, as OpenAI
    lists them (`order` desc by default, `limit` 1..100, `after` an item id)."""
    items = orjson.loads(record.input)
    listed = [
        {**item, "id": item.get("id") or f"{record.id}_input_{index}"}
        for index, item in enumerate(items)
    ]
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise client_error(400, "`order` must be `asc` or `desc`", "order")
    if order == "desc":
        listed.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in listed]
        if after not in ids:
            raise client_error(400, f"`after` names no input item of {record.id}", "after")
        listed = listed[ids.index(after) + 1 :]
    raw_limit = query.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= 100:
        raise client_error(400, "`limit` must be an integer in 1..100", "limit")
    limit = int(raw_limit)
    page = listed[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(listed) > limit,
    }


async def relay_events(
    reply: Reply,
    call: Call,
    stream: ResponsesStream,
    keep: Callable[[dict[str, Any], bytes], Awaitable[None]],
) -> None:
    """Commit the 200 (output exists by now) and forward the events as they come; the
    response is kept before the event that ends the stream goes out."""
    await reply.open_stream(stream_headers(call))
    async for data in stream:
        if stream.done:
            response = stream.response
            assert response is not None
            await keep(response, orjson.dumps(response))
            call.output_tokens = output_tokens(response)
            call.status = 200
            await reply.end(data)
            call.sequence_number = stream.sequence_number
            return
        await reply.write(data)
        call.sequence_number = stream.sequence_number


async def answer_whole(
    reply: Reply,
    call: Call,
    stream: ResponsesStream,
    keep: Callable[[dict[str, Any], bytes], Awaitable[None]],
) -> None:
    """The stream read to its end, and the response it ended with as one answer."""
    response = await stream.rest()
    body = orjson.dumps(response)
    await keep(response, body)
    call.output_tokens = output_tokens(response)
    call.status = 200
    await reply.answer(200, body, answer_headers(call))


def output_tokens(response: dict[str, Any]) -> int | None:
    usage = response.get("usage")
    tokens = usage.get("output_tokens") if isinstance(usage, dict) else None
    return tokens if type(tokens) is int else None
