"""The bench's load generator on the Responses route (the matrix's `responses` row): each
request of a shape asked there, and its answers counted as strictly as the other routes'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench_load import RESPONSES, BatchResult, Call, calls, run_batch

from support.stack import MODEL, StackFactory, arm


def first(shape: str, index: int = 0, max_tokens: int = 32) -> Call:
    """The request a load process starting at `index` of the shape's sequence sends first."""
    return next(calls(shape, max_tokens, MODEL, index))


def test_a_request_asked_on_the_responses_route_keeps_its_input_bound_and_streaming() -> None:
    streamed = first("default").as_responses()
    assert streamed.route == RESPONSES and streamed.stream
    assert streamed.body["max_output_tokens"] == 32 and streamed.body["stream"] is True
    assert streamed.body["input"] == first("default").body["prompt"]
    assert "store" not in streamed.body  # the route's default: stored
    # The mixed shape alternates completions and chat; a chat request's last message is
    # the input, and its own output bound is kept.
    for index in (0, 1):
        asked = first("mixed-nonstream", index)
        whole = asked.as_responses()
        assert whole.route == RESPONSES and not whole.stream and whole.body["stream"] is False
        assert whole.body["max_output_tokens"] == asked.max_tokens == whole.max_tokens
        prompt = asked.body.get("prompt") or asked.body["messages"][-1]["content"]
        assert whole.body["input"] == prompt


@pytest.mark.parametrize("shape", ["default", "mixed-nonstream"])
async def test_a_batch_on_the_responses_route_counts_every_output_token(
    make_stack: StackFactory, tmp_path: Path, shape: str
) -> None:
    store = {"path": str(tmp_path / "responses.sqlite3")}
    async with make_stack(responses=store) as stack:
        job: dict[str, Any] = {
            "target": {"name": "narwhal +responses", "url": stack.url, "responses": True},
            "concurrency": 2,
            "shape": shape,
            "max_tokens": 8,
            "model": MODEL,
            "offset": 0,
            "requests": 6,
        }
        result: BatchResult = await run_batch(job)
        assert (result.ok, result.errors) == (6, 0), result.error_samples
        assert result.tokens == sum(first(shape, i, 8).max_tokens for i in range(6))
        paths = {r.path for e in ("d0", "p0") for r in stack.engine(e).received}
        assert paths == {RESPONSES}


async def test_a_responses_stream_cut_before_it_completed_is_an_error(
    make_stack: StackFactory,
) -> None:
    async with make_stack(responses={"store": "off"}) as stack:
        # Fewer deltas than asked, then a clean end: the count does not match.
        job: dict[str, Any] = {
            "target": {"name": "narwhal +responses", "url": stack.url, "responses": True},
            "concurrency": 1,
            "shape": "default",
            "max_tokens": 8,
            "model": MODEL,
            "offset": 0,
            "requests": 1,
        }
        arm(stack.engine("d0"), phase="decode", close_after=3)
        result = await run_batch(job)
    assert (result.ok, result.errors) == (0, 1)
    assert "stream ended badly: 3/8 tokens, done=False" in result.error_samples[0]
