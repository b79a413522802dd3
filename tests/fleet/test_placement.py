"""Placement policies: prefix affinity within the load bound, session hashing, p2c."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.placement import PlacementConfig, Policy
from narwhal.engines.kv_events import CacheChange
from narwhal.fleet.placement import Placer, rendezvous, within_bound


@dataclass(eq=False)
class FakeEngine:
    id: str
    seats: float = 0.0
    placed: list[str] = field(default_factory=list)

    def load(self) -> float:
        return self.seats


def engines(n: int) -> list[FakeEngine]:
    return [FakeEngine(f"e{i}") for i in range(n)]


def chat(*contents: str, user: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": c} for c in contents]}
    if user is not None:
        body["user"] = user
    return body


def place(placer: Placer, fleet: list[FakeEngine], body: dict[str, Any]) -> tuple[str, int]:
    key = placer.key(body)
    engine, matched = placer.choose("prefill", fleet, key)
    assert engine is not None
    placer.placed("prefill", engine.id, key)
    return engine.id, matched


LONG = "x" * 1000


def test_p2c_never_reads_the_prompt() -> None:
    placer = Placer(PlacementConfig(policy=Policy.P2C), random.Random(1))
    assert placer.key(chat(LONG)) is None


def test_a_conversation_returns_to_the_engine_holding_its_prefix() -> None:
    placer = Placer(PlacementConfig(), random.Random(1))
    fleet = engines(4)
    first, matched = place(placer, fleet, chat(LONG))
    assert matched == 0
    for turn in range(1, 6):
        # Other traffic on the other engines keeps every engine's recent share even.
        for other in fleet:
            if other.id != first:
                placer.placed("prefill", other.id, placer.key(chat(f"{turn}{other.id}")))
        chosen, matched = place(placer, fleet, chat(LONG, "answer " * turn, "more"))
        assert chosen == first
        assert matched >= len(LONG) // 64


def test_a_short_match_is_not_worth_steering_for() -> None:
    placer = Placer(PlacementConfig(min_chunks=3), random.Random(1))
    fleet = engines(2)
    fleet[0].seats = 5  # busy
    placer.placed("prefill", "e0", placer.key(chat("a" * 130)))
    chosen, matched = place(placer, fleet, chat("a" * 130))
    assert (chosen, matched) == ("e1", 0)
    assert placer.by_load["prefill"] >= 1


@given(st.integers(2, 6), st.floats(0, 1), st.integers(1, 200))
def test_a_hot_prefix_spreads_within_the_load_bound(n: int, slack: float, requests: int) -> None:
    config = PlacementConfig(load_slack=slack, load_window=32)
    placer = Placer(config, random.Random(3))
    fleet = engines(n)
    for i in range(requests):
        place(placer, fleet, chat(LONG, f"question {i}"))
        recent = placer.recent("prefill")
        total = sum(recent.values())
        # No engine holds more of the window than the bound allows (plus the one placed).
        assert max(recent.values()) <= math.ceil((1 + slack) * total / n) + 1


def test_within_bound_is_bounded_load_hashing() -> None:
    assert within_bound(0, 0, 4, 0.0)
    assert within_bound(1, 7, 4, 0.0)  # 2 of 8: an even share
    assert not within_bound(2, 7, 4, 0.0)  # 3 of 8: more
    assert within_bound(2, 7, 4, 0.5)  # up to 3 of 8 with half again


def test_session_hashing_keeps_a_user_and_moves_only_those_of_a_lost_engine() -> None:
    placer = Placer(PlacementConfig(policy=Policy.SESSION), random.Random(1))
    fleet = engines(4)
    before = {u: place(placer, fleet, chat("hi", user=f"u{u}"))[0] for u in range(200)}
    again = {u: place(placer, fleet, chat("other", user=f"u{u}"))[0] for u in range(200)}
    assert before == again
    assert len(set(before.values())) == 4
    after = {u: place(placer, fleet[1:], chat("hi", user=f"u{u}"))[0] for u in range(200)}
    assert {u for u in before if before[u] != after[u]} == {u for u in before if before[u] == "e0"}


def test_rendezvous_of_no_candidates_is_none() -> None:
    assert rendezvous([], "s") is None


def test_evicted_blocks_take_chunks_from_the_index() -> None:
    config = PlacementConfig(chunk_chars=64, chars_per_token=4.0)
    placer = Placer(config, random.Random(1))
    key = placer.key({"prompt": "z" * 64 * 10})
    assert key is not None
    placer.placed("prefill", "e0", key)
    assert placer.index.size("e0") == 10
    placer.cache_changed("e0", CacheChange("stored", 1, block_size=16))
    # One block of 16 tokens is about 64 characters: one chunk.
    placer.cache_changed("e0", CacheChange("removed", 3))
    assert placer.index.size("e0") == 7
    assert placer.match("e0", key) == 7
    # Half a chunk's worth waits for the next eviction.
    placer.cache_changed("e0", CacheChange("stored", 1, block_size=8))
    placer.cache_changed("e0", CacheChange("removed", 1))
    assert placer.index.size("e0") == 7
    placer.cache_changed("e0", CacheChange("removed", 1))
    assert placer.index.size("e0") == 6
    placer.cache_changed("e0", CacheChange("cleared"))
    assert placer.index.size("e0") == 0


def test_counts_per_phase_follow_the_window() -> None:
    placer = Placer(PlacementConfig(load_window=3), random.Random(1))
    for engine in ("a", "a", "b", "c"):
        placer.placed("decode", engine, None)
    assert placer.recent("decode") == Counter({"a": 1, "b": 1, "c": 1})
    assert placer.recent("prefill") == Counter()


def test_a_lone_candidate_is_placed_on_with_the_prefix_it_holds() -> None:
    placer = Placer(PlacementConfig(), random.Random(1))
    fleet = engines(1)
    assert place(placer, fleet, chat(LONG)) == ("e0", 0)
    engine, matched = place(placer, fleet, chat(LONG))
    assert engine == "e0" and matched == len(LONG) // 64
