"""Stream continuation end to end: a consumer that fails mid-answer, and the client still
gets one complete answer, equal to the uninterrupted one (greedy, on the simulator)."""

from __future__ import annotations

from typing import Any

import pytest

from support.stack import (
    CHAT,
    COMPLETION,
    Stack,
    StackFactory,
    arm,
    router_state,
    settled,
    sse_payloads,
    terminal_error,
)

# The core of the request path: over the fast lane and over aiohttp alike.
pytestmark = pytest.mark.both_lanes


TWO_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
# Greedy answers long enough to be cut in the middle.
GREEDY_COMPLETION = {**COMPLETION, "max_tokens": 24, "temperature": 0}
GREEDY_CHAT = {**CHAT, "max_tokens": 24, "temperature": 0}
FAULTS = {
    "crash": {"crash_after": 7},
    "cut": {"close_after": 7},
    "silence": {"silence_after": 7, "silence_s": 30},
    "error_object": {"error_after": 7},
}
# A silent consumer is found after 2 s: long enough that a healthy one on a loaded machine
# is not taken for silent.
ENGINE = {"decode_read_timeout_s": 2.0, "first_token_timeout_s": 10.0}
ON = {"enabled": True}


def _route(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


async def _answer(stack: Stack, body: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    """The text and usage the official client assembles."""
    client = stack.openai()
    chat = "messages" in body
    options = {k: v for k, v in body.items() if k != "model"}
    if stream:
        options["stream"] = True
        options["stream_options"] = {"include_usage": True}
    call = client.chat.completions.create if chat else client.completions.create
    answer = await call(model=body["model"], **options)
    if not stream:
        choice = answer.choices[0]
        text = choice.message.content if chat else choice.text
        return text or "", answer.usage.model_dump()
    parts, usage, finishes = [], None, []
    async for chunk in answer:
        if chunk.usage is not None:
            assert usage is None, "one usage block"
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            parts.append(piece or "")
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert finishes == ["length"], finishes
    assert usage is not None
    return "".join(parts), usage


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("body", [GREEDY_COMPLETION, GREEDY_CHAT], ids=["completion", "chat"])
async def test_a_consumer_failing_mid_answer_is_continued_byte_for_byte(
    make_stack: StackFactory, body: dict[str, Any], kind: str, stream: bool
) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation=ON) as stack:
        expected = await _answer(stack, body, stream)
        # An idle fleet places on d0 first (equal loads, list order); d1 takes the rest.
        arm(stack.engine("d0"), phase="decode", times=1, **FAULTS[kind])
        got = await _answer(stack, body, stream)
        assert got == expected
        entries = await stack.journal(expect=2)
        entry = entries[-1]
        assert entry["outcome"] == "ok"
        assert entry["continuations"] == 1, entry
        assert entry["replayed_tokens"] >= 1
        assert entry["output_tokens"] == 24
        if kind != "crash":
            await settled(stack)


async def test_the_stream_has_one_id_one_finish_and_one_done(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation=ON) as stack:
        arm(stack.engine("d0"), phase="decode", times=1, close_after=5)
        body = {**GREEDY_COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        async with stack.http.post(
            stack.url + "/v1/completions",
            json=body,
            headers={"X-Narwhal-Continuation": "report"},
        ) as response:
            assert response.status == 200
            text = await response.text()
        assert text.count("data: [DONE]") == 1 and text.endswith("data: [DONE]\n\n")
        assert ": narwhal continued the answer after" in text
        payloads = sse_payloads(text)
        assert len({p["id"] for p in payloads}) == 1
        assert len({p["created"] for p in payloads}) == 1
        choices = [c for p in payloads for c in p["choices"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        usages = [p["usage"] for p in payloads if p.get("usage")]
        assert len(usages) == 1 and usages[0]["completion_tokens"] == 24
        # The router's own token ids are not the client's to see.
        assert all(c["token_ids"] is None for p in payloads for c in p["choices"])
        assert all(c["prompt_token_ids"] is None for p in payloads for c in p["choices"])
        state = await settled(stack)
        assert state["continuation"]["continued"] == 1
        async with stack.http.get(stack.url + "/metrics") as response:
            metrics = await response.text()
        assert 'narwhal_continued_requests_total{outcome="ok"} 1.0' in metrics
        assert "narwhal_continuations_total 1.0" in metrics


async def test_a_continuation_is_placed_where_the_prompt_is_cached(
    make_stack: StackFactory,
) -> None:
    roles = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    # A prompt of several index chunks, so that prefix placement can steer by it.
    prompt = " ".join(f"tide{i}" for i in range(60))
    body = {**GREEDY_COMPLETION, "prompt": prompt, "stream": True}
    async with make_stack(roles, engine=ENGINE, continuation=ON) as stack:
        arm(stack.engine("d0"), phase="decode", times=1, close_after=5)
        status, _ = await stack.post("/v1/completions", body)
        assert status == 200
        (entry,) = await stack.journal(expect=1, kind="request")
        state = await router_state(stack)
    assert entry["continuations"] == 1, entry
    # The replay (the prompt and the answer so far) went to the producer expected to hold
    # the prompt, the one that prefilled it: steered there, not placed by load.
    assert entry["producer"] == "p0"
    assert entry["prefix_matched"] >= len(prompt) // 64
    assert state["placement"]["steered"]["prefill"] == 1


async def test_ids_the_client_asked_for_are_kept_and_continue(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation=ON) as stack:
        body = {**GREEDY_COMPLETION, "stream": True, "return_token_ids": True}
        status, clean = await stack.post("/v1/completions", body)
        arm(stack.engine("d0"), phase="decode", times=1, close_after=5)
        status, cut = await stack.post("/v1/completions", body)
        assert status == 200

        def ids(text: str) -> tuple[list[Any], list[int]]:
            payloads = sse_payloads(text)
            prompts = [c["prompt_token_ids"] for p in payloads for c in p["choices"]]
            generated = [t for p in payloads for c in p["choices"] for t in c["token_ids"]]
            return [p for p in prompts if p is not None], generated

        assert ids(cut) == ids(clean)
        assert len(ids(clean)[1]) == 24


async def test_an_ineligible_request_ends_as_before(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation=ON) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", times=1, close_after=5)
        body = {**GREEDY_COMPLETION, "stream": True, "stop": ["zzz"]}
        status, text = await stack.post("/v1/completions", body)
        assert status == 200
        error = terminal_error(text)
        assert "decode stream from engine d0 broke" in error["message"]
        assert "not continued" not in error["message"]
        entry = (await stack.journal())[-1]
        assert entry["continuations"] == 0
        await settled(stack)


async def test_max_attempts_bounds_continuations(make_stack: StackFactory) -> None:
    async with make_stack(
        TWO_CONSUMERS, engine=ENGINE, continuation={**ON, "max_attempts": 1}
    ) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", times=2, close_after=3)
        status, text = await stack.post("/v1/completions", {**GREEDY_COMPLETION, "stream": True})
        assert status == 200
        error = terminal_error(text)
        assert "not continued: continuation.max_attempts (1) used" in error["message"]
        await settled(stack)


async def test_the_budget_bounds_continuations_router_wide(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation={**ON, "budget": 0}) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", times=1, close_after=3)
        _, text = await stack.post("/v1/completions", {**GREEDY_COMPLETION, "stream": True})
        error = terminal_error(text)
        assert "continuation budget (continuation.budget) is spent" in error["message"]


async def test_tracked_tokens_are_bounded(make_stack: StackFactory) -> None:
    async with make_stack(
        TWO_CONSUMERS, engine=ENGINE, continuation={**ON, "max_tracked_tokens": 4}
    ) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", times=1, close_after=6)
        _, text = await stack.post("/v1/completions", {**GREEDY_COMPLETION, "stream": True})
        error = terminal_error(text)
        assert "continuation.max_tracked_tokens (4)" in error["message"]
        await settled(stack)


async def test_off_ends_as_before(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation={"enabled": False}) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", times=1, close_after=3)
        _, text = await stack.post("/v1/completions", {**GREEDY_COMPLETION, "stream": True})
        error = terminal_error(text)
        assert "not continued" not in error["message"]
        await settled(stack)


async def test_a_token_whose_text_was_held_is_generated_again_not_lost(
    make_stack: StackFactory,
) -> None:
    # Engines whose tokens may carry no text (part of a multi-byte character, a skipped
    # special token): the ids delivered run ahead of the text delivered. Paced slowly
    # enough that each token is its own event.
    sim = {"empty_token_probability": 0.3, "inter_token_s": 0.02}
    async with make_stack(TWO_CONSUMERS, engine=ENGINE, continuation=ON, sim=sim) as stack:
        body = {**GREEDY_COMPLETION, "stream": True, "return_token_ids": True}
        _, clean = await stack.post("/v1/completions", body)
        events = [
            (c["text"], len(c["token_ids"])) for p in sse_payloads(clean) for c in p["choices"]
        ]
        # A token with no text right after one with text: the cut comes just after it.
        held = next(i for i in range(1, len(events) - 1) if not events[i][0] and events[i - 1][0])
        arm(stack.engine("d0"), phase="decode", times=1, close_after=held + 1)
        async with stack.http.post(
            stack.url + "/v1/completions", json=body, headers={"X-Narwhal-Continuation": "report"}
        ) as response:
            cut = await response.text()
        before, marker, _ = cut.partition(": narwhal continued the answer after ")
        assert marker, cut
        delivered = [
            (c["text"], c["token_ids"]) for p in sse_payloads(before) for c in p["choices"]
        ]
        ids = [t for _, event in delivered for t in event]
        with_text = max(i for i, (text, _) in enumerate(delivered) if text)
        committed = sum(len(event) for _, event in delivered[: with_text + 1])
        # The client saw ids past its text; G stops at the last text, the rest is replayed.
        assert committed < len(ids) == held + 1, delivered
        entry = (await stack.journal(expect=2))[-1]
        assert entry["continuations"] == 1 and entry["replayed_tokens"] == committed, entry

        # Nothing lost, nothing doubled: text and ids as the uninterrupted answer.
        def whole(text: str) -> tuple[str, list[int]]:
            choices = [c for p in sse_payloads(text) for c in p["choices"]]
            return "".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]]

        assert whole(cut) == whole(clean)
        await settled(stack)
