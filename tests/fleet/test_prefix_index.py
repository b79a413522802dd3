"""The prefix index: chained chunk keys and each engine's least recently used chunks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.fleet.prefix_index import PrefixIndex, chunk_keys, prompt_text

texts = st.text(alphabet="abcdé \n", max_size=400)


@given(texts, texts, st.integers(1, 64))
def test_texts_share_a_key_exactly_as_far_as_they_share_whole_chunks(
    a: str, b: str, size: int
) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ka, kb = chunk_keys(a, size), chunk_keys(b, size)
    assert len(ka) == len(a) // size
    shared = 0
    while shared < min(len(ka), len(kb)) and ka[shared] == kb[shared]:
        shared += 1
    assert shared == min(common // size, len(ka), len(kb))


def test_a_chunk_key_stands_for_everything_before_it() -> None:
    # The same second chunk after a different first chunk is a different key.
    assert chunk_keys("aaaaXXXX", 4)[1] != chunk_keys("bbbbXXXX", 4)[1]


def test_prompt_text_reads_completions_chats_and_token_ids() -> None:
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": ["hello"]}) == "hello"
    assert prompt_text({"prompt": [1, 22, 333]}) == "1 22 333"
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "hello"}]}
    text, more = prompt_text(chat), prompt_text(longer)
    assert text is not None and more is not None and more.startswith(text)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(parts) == prompt_text({"messages": [{"role": "user", "content": "hi"}]})
    # A Responses input reads as the messages it stands for.
    assert prompt_text({"input": "x"}) == prompt_text(
        {"messages": [{"role": "user", "content": "x"}]}
    )
    assert prompt_text({"max_tokens": 3}) is None


@given(st.lists(st.lists(st.integers(0, 50), max_size=12), max_size=30), st.integers(1, 40))
def test_the_index_never_holds_more_than_its_capacity(prompts: list[list[int]], cap: int) -> None:
    index = PrefixIndex(cap)
    for keys in prompts:
        index.record("e", keys)
        assert index.size("e") <= cap


def test_a_recorded_prompt_matches_in_full_and_its_extension_up_to_it() -> None:
    index = PrefixIndex(100)
    index.record("e0", [1, 2, 3])
    assert index.matched("e0", [1, 2, 3]) == 3
    assert index.matched("e0", [1, 2, 3, 4, 5]) == 3
    assert index.matched("e0", [9, 2, 3]) == 0
    assert index.matched("e1", [1, 2, 3]) == 0


def test_evictions_take_a_prompts_tail_first_and_leave_its_head_matchable() -> None:
    index = PrefixIndex(100)
    index.record("e", [1, 2, 3, 4])
    index.record("e", [7, 8])
    assert index.forget_oldest("e", 2) == 2
    # The older prompt lost its last two chunks; its first two still match.
    assert index.matched("e", [1, 2, 3, 4]) == 2
    assert index.matched("e", [7, 8]) == 2
    assert index.forget_oldest("e", 99) == 4
    assert index.size("e") == 0


def test_a_reused_prompt_is_the_most_recent_and_outlives_others() -> None:
    index = PrefixIndex(4)
    index.record("e", [1, 2])
    index.record("e", [5, 6])
    index.record("e", [1, 2])
    index.record("e", [8, 9])  # over capacity: [5, 6] go, not the reused [1, 2]
    assert index.matched("e", [1, 2]) == 2
    assert index.matched("e", [5, 6]) == 0


def test_clear_forgets_one_engine() -> None:
    index = PrefixIndex(10)
    index.record("a", [1])
    index.record("b", [1])
    index.clear("a")
    assert (index.size("a"), index.size("b")) == (0, 1)


def test_a_responses_follow_up_shares_its_first_turns_prefix() -> None:
    first = prompt_text({"input": "Tell me about whales", "instructions": "Be brief."})
    follow_up = prompt_text(
        {
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "user", "content": "Tell me about whales"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "They are large."}],
                },
                {"role": "user", "content": [{"type": "input_text", "text": "How large?"}]},
            ],
        }
    )
    assert first is not None and follow_up is not None
    assert follow_up.startswith(first)
    assert follow_up.endswith("assistant\x1eThey are large.\x1euser\x1eHow large?\x1e")
    assert prompt_text({"input": "a"}) != prompt_text({"input": "b"})
