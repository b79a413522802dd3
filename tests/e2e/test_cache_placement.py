"""Cache-aware placement through the real router: a conversation's turns return to the
producer that holds its prefix, and the engine's own usage shows the cached tokens."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from support.stack import MODEL, StackFactory, router_state

ROLES = (("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"), ("d0", "decode"))


def words(seed: str, count: int) -> str:
    return " ".join(f"{seed}{i}" for i in range(count))


async def test_a_conversation_stays_with_its_cached_prefix(make_stack: StackFactory) -> None:
    # A lenient load bound: the bound itself is the unit tests' (tests/fleet/test_placement.py).
    placement: dict[str, Any] = {"policy": "prefix", "load_slack": 10.0}
    sim = {"enable_prompt_tokens_details": True}
    async with make_stack(ROLES, sim=sim, placement=placement) as stack:
        client = stack.openai()
        history: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": words("rule", 120)}
        ]
        cached: list[int] = []
        for turn in range(4):
            # Unrelated one-off chats between the turns.
            for other in range(2):
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": words(f"x{turn}{other}y", 80)}],
                    max_tokens=2,
                )
            history.append({"role": "user", "content": words(f"q{turn}w", 60)})
            answer = await client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=4, user="alice"
            )
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
            history.append({"role": "assistant", "content": words(f"a{turn}z", 40)})
        lines = await stack.journal(expect=12, kind="request")
        state = await router_state(stack)
    turns = [line for i, line in enumerate(lines) if i % 3 == 2]
    producers = {line["producer"] for line in turns}
    assert len(producers) == 1, [line["producer"] for line in turns]
    # The first turn was placed by load; each later one by the prefix it expected, and the
    # producer held it: its usage reports the earlier turns' tokens as cached.
    assert turns[0]["prefix_matched"] == 0
    assert all(line["prefix_matched"] > 0 for line in turns[1:])
    assert cached[0] == 0
    assert 0 < cached[1] < cached[2] < cached[3]
    placed = state["placement"]
    assert placed["policy"] == "prefix"
    assert placed["steered"]["prefill"] >= 3
    (producer,) = producers
    assert placed["engines"][producer]["indexed_chunks"] > 0
    assert placed["engines"][producer]["kv_events"] is None


async def test_p2c_keeps_no_index(make_stack: StackFactory) -> None:
    async with make_stack(ROLES, placement={"policy": "p2c"}) as stack:
        client = stack.openai()
        for _ in range(3):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": words("same", 100)}],
                max_tokens=2,
            )
        state = await router_state(stack)
        lines = await stack.journal(expect=3, kind="request")
    assert state["placement"]["policy"] == "p2c"
    assert all(e["indexed_chunks"] == 0 for e in state["placement"]["engines"].values())
    assert state["placement"]["by_load"]["prefill"] == 3
    assert [line["prefix_matched"] for line in lines] == [0, 0, 0]
