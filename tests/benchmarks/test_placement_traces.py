"""The placement benchmark's traces: what each repeats, and that a seed fixes them."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from placement_traces import build, multi_turn, no_reuse, shared_prompts

from narwhal.fleet.prefix_index import chunk_keys, prompt_text


def text(messages: tuple[tuple[str, str], ...]) -> str:
    body = {"messages": [{"role": r, "content": c} for r, c in messages]}
    found = prompt_text(body)
    assert found is not None
    return found


def test_a_seed_fixes_the_trace() -> None:
    assert build("multi-turn", 4) == build("multi-turn", 4)
    assert build("multi-turn", 4) != build("multi-turn", 5)
    with pytest.raises(ValueError, match="unknown trace 'x'; traces: multi-turn, shared"):
        build("x", 1)


def test_each_turn_resends_the_conversation_so_far() -> None:
    for session in multi_turn(1, users=5):
        texts = [text(turn.messages) for turn in session.turns]
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
        assert len(session.turns) >= 5


def test_the_control_shares_no_chunk_between_requests() -> None:
    firsts = [chunk_keys(text(s.turns[0].messages), 64)[0] for s in no_reuse(1, requests=100)]
    assert len(set(firsts)) == 100


def test_shared_prompts_have_one_hot_system_prompt() -> None:
    systems = Counter(s.turns[0].messages[0][1] for s in shared_prompts(1, requests=400))
    assert len(systems) == 4
    assert 0.4 < systems.most_common(1)[0][1] / 400 < 0.6
