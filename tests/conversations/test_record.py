"""What every conversation store does (`ConversationStore`), shown on each: the SQLite file
and a real Redis server (`make_store` opens both in turn)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from narwhal.conversations.record import ConversationStore, NotStored, StoredResponse

MakeStore = Callable[..., Awaitable[ConversationStore]]
Turn = Callable[..., StoredResponse]
Chain = Callable[..., list[StoredResponse]]


async def put_all(store: ConversationStore, records: list[StoredResponse]) -> None:
    for record in records:
        await store.put(record)


async def test_a_stored_response_reads_back_as_it_was_put(
    make_store: MakeStore, chain: Chain
) -> None:
    store = await make_store()
    first, second = chain(2, tenant="acme")
    await put_all(store, [first, second])
    assert await store.get("resp_1", "acme") == second
    assert await store.get("resp_0", "acme") == first
    assert b"\n" in second.input and b"\n" in second.response
    assert await store.get("resp_2", "acme") is None


async def test_a_put_of_the_same_id_replaces_the_response(
    make_store: MakeStore, turn: Turn
) -> None:
    store = await make_store()
    await store.put(turn("resp_a", model="one"))
    await store.put(turn("resp_a", model="two", created_at=1001.0))
    stored = await store.get("resp_a", None)
    assert stored is not None
    assert (stored.model, stored.created_at) == ("two", 1001.0)


async def test_a_conversation_is_every_response_up_to_the_one_named_oldest_first(
    make_store: MakeStore, chain: Chain
) -> None:
    store = await make_store()
    records = chain(5)
    # Stored out of order: the order comes from the ancestors, not from the puts.
    await put_all(store, [records[3], records[0], records[4], records[2], records[1]])
    assert await store.conversation("resp_4", None) == records
    assert await store.conversation("resp_2", None) == records[:3]
    assert await store.conversation("resp_0", None) == records[:1]


async def test_a_conversation_names_the_first_response_missing(
    make_store: MakeStore, chain: Chain
) -> None:
    store = await make_store()
    records = chain(5)
    await put_all(store, records)
    assert await store.delete("resp_3", None)
    with pytest.raises(NotStored) as missing:
        await store.conversation("resp_4", None)
    assert missing.value.response_id == "resp_3"
    assert await store.delete("resp_1", None)
    with pytest.raises(NotStored) as missing:
        await store.conversation("resp_4", None)
    assert missing.value.response_id == "resp_1"
    # Before the gaps, the conversation is whole.
    assert await store.conversation("resp_0", None) == records[:1]
    with pytest.raises(NotStored) as missing:
        await store.conversation("resp_unknown", None)
    assert missing.value.response_id == "resp_unknown"


async def test_a_delete_says_whether_there_was_a_response(
    make_store: MakeStore, turn: Turn
) -> None:
    store = await make_store()
    await store.put(turn("resp_a"))
    assert await store.delete("resp_a", None)
    assert await store.get("resp_a", None) is None
    assert not await store.delete("resp_a", None)
    assert not await store.delete("resp_never", None)
    with pytest.raises(NotStored):
        await store.conversation("resp_a", None)


async def test_another_tenants_response_is_as_absent_as_one_never_stored(
    make_store: MakeStore, chain: Chain, turn: Turn
) -> None:
    store = await make_store()
    records = chain(3, tenant="acme")
    await put_all(store, records)
    await store.put(turn("resp_untenanted"))
    for other in ("globex", None):
        assert await store.get("resp_2", other) is None
        with pytest.raises(NotStored) as missing:
            await store.conversation("resp_2", other)
        assert missing.value.response_id == "resp_2"
        assert not await store.delete("resp_2", other)
    assert await store.get("resp_untenanted", "acme") is None
    # What the other tenants tried left the owner's conversation whole.
    assert await store.conversation("resp_2", "acme") == records


async def test_a_conversation_stops_at_an_ancestor_of_another_tenant(
    make_store: MakeStore, turn: Turn
) -> None:
    store = await make_store()
    theirs = turn("resp_theirs", tenant="globex")
    mine = turn("resp_mine", theirs, tenant="acme")
    await put_all(store, [theirs, mine])
    with pytest.raises(NotStored) as missing:
        await store.conversation("resp_mine", "acme")
    assert missing.value.response_id == "resp_theirs"


async def test_a_response_older_than_max_age_is_absent_before_it_is_removed(
    make_store: MakeStore, turn: Turn, now: list[float]
) -> None:
    store = await make_store(max_age_s=60.0)
    old = turn("resp_old", created_at=1000.0)
    new = turn("resp_new", old, created_at=1030.0)
    await put_all(store, [old, new])
    now[0] = 1060.0
    assert await store.conversation("resp_new", None) == [old, new]
    now[0] = 1060.5
    assert await store.get("resp_old", None) is None
    assert await store.get("resp_new", None) == new
    with pytest.raises(NotStored) as missing:
        await store.conversation("resp_new", None)
    assert missing.value.response_id == "resp_old"
    assert not await store.delete("resp_old", None)
    now[0] = 1091.0
    assert await store.get("resp_new", None) is None
    assert await store.prune() >= 1
    assert await store.prune() == 0


async def test_beyond_max_stored_the_oldest_go(make_store: MakeStore, turn: Turn) -> None:
    store = await make_store(max_stored=3)
    # Put newest first: "oldest" is by creation time.
    for index in reversed(range(5)):
        await store.put(turn(f"resp_{index}", created_at=1000.0 + index))
    await store.prune()
    assert await store.prune() == 0
    kept = [index for index in range(5) if await store.get(f"resp_{index}", None) is not None]
    assert kept == [2, 3, 4]


async def test_many_tasks_put_and_read_at_once(make_store: MakeStore, turn: Turn) -> None:
    store = await make_store()
    records = [turn(f"resp_{index}", tenant=f"t{index % 3}") for index in range(64)]
    await asyncio.gather(*(store.put(record) for record in records))
    read = await asyncio.gather(*(store.get(record.id, record.tenant) for record in records))
    assert read == records
