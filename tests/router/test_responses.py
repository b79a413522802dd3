"""The Responses route's own part of a request: the conversation a follow-up continues, rebuilt
from a store kept in memory here; the response kept once answered; the input items listed; the
events relayed and the whole answer given."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import pytest

from narwhal.config.responses import ResponsesConfig, StoreKind
from narwhal.conversations.record import ConversationStore, NotStored, StoredResponse
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.call import Call
from narwhal.router.reply import Reply
from narwhal.router.responses import (
    Conversations,
    answer_whole,
    input_items_page,
    relay_events,
)


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def typed(text: str) -> dict[str, Any]:
    """A string input as an item: one user message of one text part."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def stored(
    response_id: str,
    items: list[dict[str, Any]],
    output: list[dict[str, Any]],
    *,
    ancestors: tuple[str, ...] = (),
    tenant: str | None = "t1",
) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        tenant=tenant,
        model="m",
        created_at=time.time(),
        previous_id=ancestors[-1] if ancestors else None,
        ancestors=ancestors,
        input=orjson.dumps(items),
        response=orjson.dumps({"id": response_id, "object": "response", "output": output}),
    )


class MemoryStore:
    """A conversation store in a dict: a response is another tenant's as if never stored."""

    def __init__(self, *records: StoredResponse) -> None:
        self.records = {record.id: record for record in records}
        self.closed = False
        self.failing: Exception | None = None

    async def put(self, record: StoredResponse) -> None:
        if self.failing is not None:
            raise self.failing
        self.records[record.id] = record

    async def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        record = self.records.get(response_id)
        return record if record is not None and record.tenant == tenant else None

    async def conversation(self, response_id: str, tenant: str | None) -> list[StoredResponse]:
        last = await self.get(response_id, tenant)
        if last is None:
            raise NotStored(response_id)
        turns = []
        for ancestor in last.ancestors:
            turn = await self.get(ancestor, tenant)
            if turn is None:
                raise NotStored(ancestor)
            turns.append(turn)
        return [*turns, last]

    async def delete(self, response_id: str, tenant: str | None) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        del self.records[response_id]
        return True

    async def prune(self) -> int:
        return 0

    async def close(self) -> None:
        self.closed = True


class Opener:
    """Opens the store it was given (None: `store = "off"`), counting its calls; fails
    while `failure` is set."""

    def __init__(self, store: MemoryStore | None) -> None:
        self.store = store
        self.calls = 0
        self.failure: Exception | None = None

    async def __call__(self, config: ResponsesConfig) -> ConversationStore | None:
        self.calls += 1
        await asyncio.sleep(0)
        if self.failure is not None:
            raise self.failure
        return self.store


@dataclass
class Spawned:
    """The background tasks asked for, by name (their coroutines are not run)."""

    names: list[str] = field(default_factory=list)

    def __call__(self, coroutine: Coroutine[Any, Any, None], name: str) -> object:
        coroutine.close()
        self.names.append(name)
        return None


def conversations(
    store: MemoryStore | None, config: ResponsesConfig | None = None
) -> tuple[Conversations, Opener, Spawned]:
    opener, spawned = Opener(store), Spawned()
    return Conversations(config or ResponsesConfig(), opener, spawned), opener, spawned


def request(**body: Any) -> ClientRequest:
    return parse_client_request(Endpoint.RESPONSES, orjson.dumps(body), "m")


def call(tenant: str | None = "t1") -> Call:
    record = Call(
        request_id="r1",
        client_request_id=None,
        endpoint=Endpoint.RESPONSES,
        arrival=time.perf_counter(),
        deadline=asyncio.get_running_loop().time() + 60.0,
    )
    record.tenant = tenant
    record.model = "m"
    record.consumer = "d0"
    return record


def conversation_store() -> MemoryStore:
    """Two turns: r1, then r2 continuing it."""
    return MemoryStore(
        stored("r1", [user("one")], [said("1")]),
        stored(
            "r2", [user("two")], [said("2"), {"type": "reasoning", "id": "rs_2"}], ancestors=("r1",)
        ),
    )


async def refused(pending: Coroutine[Any, Any, Any]) -> NarwhalError:
    with pytest.raises(NarwhalError) as caught:
        await pending
    return caught.value


# The request path --------------------------------------------------------------------------


async def test_a_first_turn_keeps_the_clients_input() -> None:
    keeper, opener, _ = conversations(MemoryStore())
    client = request(input="hi", store=True, temperature=0.2, kv_transfer_params={"x": 1})
    sent, ancestors = await keeper.engine_request(call(), client)
    assert ancestors == ()
    assert sent.body == {"model": "m", "input": "hi", "store": False, "temperature": 0.2}
    assert sent.ask == client.ask and sent.endpoint is Endpoint.RESPONSES
    # The client's own request is left as it came.
    assert client.body["store"] is True and "kv_transfer_params" in client.body
    # The store it will be kept in is opened first (once).
    assert opener.calls == 1
    await keeper.engine_request(call(), client)
    assert opener.calls == 1


async def test_a_first_turn_not_stored_opens_no_store() -> None:
    keeper, opener, _ = conversations(MemoryStore())
    sent, ancestors = await keeper.engine_request(call(), request(input="hi", store=False))
    assert ancestors == () and sent.body["input"] == "hi"
    assert opener.calls == 0


async def test_a_first_turn_to_store_in_a_store_that_cannot_open_is_a_503_before_any_engine() -> (
    None
):
    keeper, opener, _ = conversations(MemoryStore())
    opener.failure = ConnectionError("Redis at redis://127.0.0.1:1 refused")
    error = await refused(keeper.engine_request(call(), request(input="hi")))
    assert error.status == 503
    assert error.message.startswith("the response store is unavailable"), error.message
    assert "Redis at redis://127.0.0.1:1" in error.message


async def test_a_follow_up_gets_the_whole_conversation_and_its_ancestors() -> None:
    keeper, _, _ = conversations(conversation_store())
    client = request(input=[user("three")], previous_response_id="r2")
    sent, ancestors = await keeper.engine_request(call(), client)
    assert ancestors == ("r1", "r2")
    assert sent.body["input"] == [
        user("one"),
        said("1"),
        user("two"),
        said("2"),
        {"type": "reasoning", "id": "rs_2"},
        user("three"),
    ]
    assert "previous_response_id" not in sent.body and sent.body["store"] is False
    assert client.body["input"] == [user("three")]
    assert sent.ask is not None and sent.ask.items == [user("three")]


async def test_a_follow_up_of_a_string_input_gets_it_as_a_user_message() -> None:
    keeper, _, _ = conversations(conversation_store())
    sent, ancestors = await keeper.engine_request(
        call(), request(input="three", previous_response_id="r1")
    )
    assert ancestors == ("r1",)
    assert sent.body["input"] == [user("one"), said("1"), typed("three")]


async def test_a_follow_up_of_an_unknown_response_is_a_404_naming_the_member() -> None:
    keeper, _, _ = conversations(conversation_store())
    error = await refused(
        keeper.engine_request(call(), request(input="x", previous_response_id="r9"))
    )
    assert error.status == 404 and error.param == "previous_response_id"
    assert error.message == "no response with id 'r9' is stored"
    assert error.cause is Cause.BAD_REQUEST and not error.transient


async def test_another_tenants_response_is_as_unknown() -> None:
    keeper, _, _ = conversations(conversation_store())
    error = await refused(
        keeper.engine_request(call("t2"), request(input="x", previous_response_id="r1"))
    )
    assert error.status == 404 and error.param == "previous_response_id"


async def test_a_conversation_missing_an_earlier_turn_is_a_404_naming_it() -> None:
    store = conversation_store()
    del store.records["r1"]
    keeper, _, _ = conversations(store)
    error = await refused(
        keeper.engine_request(call(), request(input="x", previous_response_id="r2"))
    )
    assert error.status == 404 and error.param == "previous_response_id"
    assert error.cause is Cause.BAD_REQUEST
    assert "'r2'" in error.message and "'r1' is not stored" in error.message


async def test_with_the_store_off_a_follow_up_is_a_404_and_nothing_is_kept() -> None:
    keeper, opener, spawned = conversations(None, ResponsesConfig(store=StoreKind.OFF))
    first, ancestors = await keeper.engine_request(call(), request(input="hi"))
    assert first.body["input"] == "hi"
    error = await refused(
        keeper.engine_request(call(), request(input="x", previous_response_id="r1"))
    )
    assert error.status == 404 and error.param == "previous_response_id"
    await keeper.keep(call(), first, ancestors, {"id": "resp_1", "output": []}, b"{}")
    assert (await refused(keeper.read("resp_1", "t1"))).param == "response_id"
    assert (await refused(keeper.delete("resp_1", "t1"))).status == 404
    # Opened once; nothing to prune.
    assert opener.calls == 1 and spawned.names == []


async def test_a_store_that_cannot_be_opened_is_a_503_tried_again_next_time() -> None:
    store = conversation_store()
    keeper, opener, spawned = conversations(store)
    opener.failure = OSError("disk is full")
    follow_up = request(input="x", previous_response_id="r1")
    error = await refused(keeper.engine_request(call(), follow_up))
    assert error.status == 503 and error.cause is Cause.UNAVAILABLE
    assert error.retry_after == 1 and error.headers() == {"Retry-After": "1"}
    assert "disk is full" in error.message
    opener.failure = None
    _, ancestors = await keeper.engine_request(call(), follow_up)
    assert ancestors == ("r1",) and opener.calls == 2
    # Opened now: the store is not opened again, and its retention runs.
    await keeper.engine_request(call(), follow_up)
    assert opener.calls == 2 and spawned.names == ["responses-retention"]


async def test_requests_arriving_together_open_the_store_once() -> None:
    keeper, opener, spawned = conversations(MemoryStore())
    opened = await asyncio.gather(*(keeper.store() for _ in range(5)))
    assert opener.calls == 1 and len(set(map(id, opened))) == 1
    assert spawned.names == ["responses-retention"]


async def test_a_kept_response_holds_its_turn_its_tenant_and_its_ancestors() -> None:
    store = conversation_store()
    keeper, _, _ = conversations(store)
    client = request(input=[user("three")], previous_response_id="r2")
    record = call()
    sent, ancestors = await keeper.engine_request(record, client)
    response = {"id": "resp_3", "model": "m-served", "output": [said("3")]}
    encoded = orjson.dumps(response)
    before = time.time()
    await keeper.keep(record, sent, ancestors, response, encoded)
    kept = store.records["resp_3"]
    assert kept.tenant == "t1" and kept.model == "m-served"
    assert kept.previous_id == "r2" and kept.ancestors == ("r1", "r2")
    # Its own turn's input only: the earlier turns are kept with their own responses.
    assert orjson.loads(kept.input) == [user("three")]
    assert kept.response == encoded
    assert before <= kept.created_at <= time.time()
    # And it can be continued from.
    again, chain = await keeper.engine_request(
        record, request(input="four", previous_response_id="resp_3")
    )
    assert chain == ("r1", "r2", "resp_3")
    assert again.body["input"][-2:] == [said("3"), typed("four")]


async def test_a_first_turn_is_kept_with_the_calls_model_when_the_response_names_none() -> None:
    store = MemoryStore()
    keeper, _, _ = conversations(store)
    sent, ancestors = await keeper.engine_request(call(None), request(input="hi"))
    await keeper.keep(call(None), sent, ancestors, {"id": "resp_1", "output": []}, b"{}")
    kept = store.records["resp_1"]
    assert kept.tenant is None and kept.model == "m"
    assert kept.previous_id is None and kept.ancestors == ()
    assert orjson.loads(kept.input) == [typed("hi")]


async def test_a_response_the_client_asked_not_to_store_is_not_kept() -> None:
    store = MemoryStore()
    keeper, opener, _ = conversations(store)
    sent, ancestors = await keeper.engine_request(call(), request(input="hi", store=False))
    await keeper.keep(call(), sent, ancestors, {"id": "resp_1", "output": []}, b"{}")
    assert store.records == {} and opener.calls == 0


async def test_a_response_without_an_id_cannot_be_kept() -> None:
    store = MemoryStore()
    keeper, _, _ = conversations(store)
    sent, _ = await keeper.engine_request(call(), request(input="hi"))
    error = await refused(keeper.keep(call(), sent, (), {"output": []}, b"{}"))
    assert error.status == 502 and error.cause is Cause.BAD_RESPONSE
    assert "d0" in error.message and store.records == {}


async def test_a_store_that_fails_to_keep_is_a_503() -> None:
    store = MemoryStore()
    store.failing = OSError("database is locked")
    keeper, _, _ = conversations(store)
    sent, _ = await keeper.engine_request(call(), request(input="hi"))
    error = await refused(keeper.keep(call(), sent, (), {"id": "resp_1"}, b"{}"))
    assert error.status == 503 and error.cause is Cause.UNAVAILABLE and error.retry_after == 1
    assert "database is locked" in error.message


# The read routes --------------------------------------------------------------------------


async def test_a_stored_response_is_read_and_deleted_by_its_tenant_only() -> None:
    store = conversation_store()
    keeper, _, _ = conversations(store)
    assert (await keeper.read("r1", "t1")).id == "r1"
    error = await refused(keeper.read("r1", "t2"))
    assert error.status == 404 and error.param == "response_id"
    assert (await refused(keeper.delete("r1", "t2"))).status == 404
    await keeper.delete("r1", "t1")
    assert "r1" not in store.records
    assert (await refused(keeper.read("r1", "t1"))).message == "no response with id 'r1' is stored"
    assert (await refused(keeper.delete("r1", "t1"))).param == "response_id"


async def test_closing_closes_the_store() -> None:
    store = MemoryStore()
    keeper, _, _ = conversations(store)
    await keeper.close()
    assert not store.closed
    await keeper.store()
    await keeper.close()
    assert store.closed


ITEMS_RECORD = stored(
    "resp_1",
    [
        {"id": "msg_a", **user("a")},
        user("b"),
        said("c"),
        {"type": "message", "id": "", "content": "d"},
    ],
    [],
)
# Items without an id of their own are named after the response and their place.
IDS = ["msg_a", "resp_1_input_1", "resp_1_input_2", "resp_1_input_3"]


def page_ids(query: Mapping[str, str]) -> list[str]:
    return [item["id"] for item in input_items_page(ITEMS_RECORD, dict(query))["data"]]


def test_input_items_are_listed_newest_first_by_default() -> None:
    page = input_items_page(ITEMS_RECORD, {})
    assert page["object"] == "list"
    assert [item["id"] for item in page["data"]] == IDS[::-1]
    assert page["first_id"] == "resp_1_input_3" and page["last_id"] == "msg_a"
    assert page["has_more"] is False
    # Each item as it was given, with its id.
    assert page["data"][2] == {**user("b"), "id": "resp_1_input_1"}


def test_input_items_are_listed_in_order_when_asked() -> None:
    assert page_ids({"order": "asc"}) == IDS


@pytest.mark.parametrize(
    ("query", "expected", "more"),
    [
        ({"order": "asc", "limit": "2"}, IDS[:2], True),
        ({"order": "asc", "limit": "4"}, IDS, False),
        ({"order": "asc", "limit": "100"}, IDS, False),
        ({"limit": "1"}, IDS[-1:], True),
        ({"order": "asc", "after": "msg_a"}, IDS[1:], False),
        ({"order": "asc", "after": "msg_a", "limit": "2"}, IDS[1:3], True),
        ({"order": "asc", "after": "resp_1_input_2", "limit": "1"}, IDS[3:], False),
        ({"after": "resp_1_input_2"}, ["resp_1_input_1", "msg_a"], False),
        ({"order": "asc", "after": "resp_1_input_3"}, [], False),
    ],
)
def test_a_page_of_input_items(query: dict[str, str], expected: list[str], more: bool) -> None:
    page = input_items_page(ITEMS_RECORD, query)
    assert [item["id"] for item in page["data"]] == expected
    assert page["has_more"] is more
    assert page["first_id"] == (expected[0] if expected else None)
    assert page["last_id"] == (expected[-1] if expected else None)


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"order": "up"}, "order"),
        ({"order": "ASC"}, "order"),
        ({"after": "msg_z"}, "after"),
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "two"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"limit": "1.5"}, "limit"),
        ({"limit": "\u00b2"}, "limit"),
    ],
)
def test_a_bad_page_query_is_a_400_naming_its_parameter(query: dict[str, str], param: str) -> None:
    with pytest.raises(NarwhalError) as caught:
        input_items_page(ITEMS_RECORD, query)
    assert caught.value.status == 400 and caught.value.param == param


# The answers -----------------------------------------------------------------------------


class Recording:
    """A client connection that records what it is given, in order."""

    def __init__(self) -> None:
        self.committed = False
        self.said: list[tuple[str, Any]] = []

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        self.committed = True
        self.said.append(("open", dict(headers)))

    async def write(self, data: bytes) -> None:
        self.said.append(("write", data))

    async def end(self, data: bytes = b"") -> None:
        self.said.append(("end", data))

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        self.said.append(("answer", (status, body, dict(headers))))


class Stream:
    """A Responses stream past its first delta, as scripted: blocks and their last numbers,
    the last block ending it with `response`."""

    def __init__(self, blocks: list[tuple[bytes, int]], response: dict[str, Any]) -> None:
        self._blocks = blocks
        self._response = response
        self.done = False
        self.response: dict[str, Any] | None = None
        self.sequence_number = -1

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        if not self._blocks:
            raise StopAsyncIteration
        data, self.sequence_number = self._blocks.pop(0)
        if not self._blocks:
            self.done, self.response = True, self._response
        return data

    async def rest(self) -> dict[str, Any]:
        while self._blocks:
            await self.__anext__()
        assert self.response is not None
        return self.response


RESPONSE = {"id": "resp_1", "output": [said("Hi")], "usage": {"output_tokens": 2}}


async def test_relayed_events_end_after_the_response_is_kept() -> None:
    reply, record = Recording(), call()
    stream = Stream([(b"held+first", 3), (b"more", 5), (b"the end", 7)], RESPONSE)
    kept: list[tuple[dict[str, Any], bytes]] = []

    async def keep(response: dict[str, Any], encoded: bytes) -> None:
        reply.said.append(("kept", response["id"]))
        kept.append((response, encoded))

    await relay_events(cast(Reply, reply), record, cast(ResponsesStream, stream), keep)
    assert [what for what, _ in reply.said] == ["open", "write", "write", "kept", "end"]
    assert [data for what, data in reply.said if what in ("write", "end")] == [
        b"held+first",
        b"more",
        b"the end",
    ]
    assert reply.said[0][1]["Content-Type"] == "text/event-stream"
    assert reply.said[0][1]["X-Request-Id"] == "r1"
    assert kept == [(RESPONSE, orjson.dumps(RESPONSE))]
    assert (record.status, record.output_tokens, record.sequence_number) == (200, 2, 7)


async def test_a_relay_cut_short_leaves_the_last_number_the_client_got() -> None:
    reply, record = Recording(), call()
    stream = Stream([(b"first", 3), (b"more", 5), (b"the end", 7)], RESPONSE)
    cut = NarwhalError(502, "cut", Cause.CLOSED_EARLY)

    async def keep(response: dict[str, Any], encoded: bytes) -> None:
        raise cut

    with pytest.raises(NarwhalError) as caught:
        await relay_events(cast(Reply, reply), record, cast(ResponsesStream, stream), keep)
    assert caught.value is cut
    assert record.sequence_number == 5 and record.status == 0
    assert [what for what, _ in reply.said] == ["open", "write", "write"]


async def test_a_whole_answer_is_the_response_the_stream_ended_with() -> None:
    reply, record = Recording(), call()
    stream = Stream([(b"first", 3), (b"the end", 7)], RESPONSE)
    kept: list[bytes] = []

    async def keep(response: dict[str, Any], encoded: bytes) -> None:
        kept.append(encoded)

    await answer_whole(cast(Reply, reply), record, cast(ResponsesStream, stream), keep)
    assert reply.said == [("answer", (200, orjson.dumps(RESPONSE), {"X-Request-Id": "r1"}))]
    assert kept == [orjson.dumps(RESPONSE)] and not reply.committed
    assert (record.status, record.output_tokens) == (200, 2)
