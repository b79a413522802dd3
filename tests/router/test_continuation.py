"""Continuation's pure shaping: ids the client already has are not given twice."""

from __future__ import annotations

from typing import Any

from narwhal.router.continuation import drop_seen


def _chunk(ids: list[int] | None) -> dict[str, Any]:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "token_ids": ids}]}


def test_replayed_ids_the_client_already_has_are_dropped_once() -> None:
    first, second = _chunk([7, 8]), _chunk([9, 10])
    seen = drop_seen(first, [7, 8, 9])
    assert first["choices"][0]["token_ids"] == [] and seen == [9]
    assert drop_seen(second, seen) == []
    assert second["choices"][0]["token_ids"] == [10]


def test_a_replay_that_drew_other_ids_drops_none() -> None:
    # A sampled answer: the replay's token differs from the one the client was given.
    chunk = _chunk([5, 8])
    assert drop_seen(chunk, [7, 8]) == []
    assert chunk["choices"][0]["token_ids"] == [5, 8]


def test_chunks_without_ids_leave_the_overhang_as_it_is() -> None:
    assert drop_seen(_chunk(None), [7]) == [7]
    assert drop_seen({"id": "cmpl-1", "choices": []}, [7]) == [7]
