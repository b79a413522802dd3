"""How each engine fault ends a request: status, message, and nothing left behind."""

from __future__ import annotations

import pytest

from support.stack import (
    COMPLETION,
    StackFactory,
    arm,
    settled,
    sse_payloads,
    terminal_error,
)

# The core of the request path: over the fast lane and over aiohttp alike.
pytestmark = pytest.mark.both_lanes


STREAM = {**COMPLETION, "stream": True}


async def test_prefill_http_error_is_502_naming_engine_and_status(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", status=503)
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        message = body["error"]["message"]
        assert "prefill on engine p0 failed with HTTP 503" in message
        assert len(stack.engine("d0").received) == 0
        await settled(stack)


async def test_an_engine_504_is_timeout_shaped(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", status=504)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 504


async def test_prefill_that_never_answers_is_504(make_stack: StackFactory) -> None:
    async with make_stack(engine={"prefill_timeout_s": 0.3}) as stack:
        arm(stack.engine("p0"), phase="prefill", hang_s=5)
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 504
        assert "prefill on engine p0 did not answer within 0.3 s" in body["error"]["message"]
        await settled(stack)


async def test_refused_connection_is_502(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), refuse_s=5)
        await stack.post("/v1/completions", COMPLETION)  # trips the refusal
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        assert "could not connect to engine d0" in body["error"]["message"]
        await settled(stack)


@pytest.mark.parametrize(
    "fault",
    [
        {"first_token_delay_s": 2.0},
        {"hang_s": 2.0},
        # Header delay and token delay spend one budget between them.
        {"hang_s": 0.3, "first_token_delay_s": 0.3},
    ],
)
async def test_no_first_token_within_the_budget_is_504(
    make_stack: StackFactory, fault: dict[str, float]
) -> None:
    async with make_stack(engine={"first_token_timeout_s": 0.45}) as stack:
        arm(stack.engine("d0"), phase="decode", **fault)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 504
        assert (
            "engine d0 produced no token within the first-token timeout (0.45 s)"
            in (body["error"]["message"])
        )
        await settled(stack)


async def test_silence_after_tokens_ends_the_stream_with_a_terminal_504(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine={"decode_read_timeout_s": 0.3}) as stack:
        arm(stack.engine("d0"), phase="decode", silence_after=3, silence_s=5)
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200
        assert len([p for p in sse_payloads(text) if p.get("choices")]) == 3
        error = terminal_error(text)
        assert error["code"] == 504
        assert error["message"].startswith("engine went silent between tokens")
        await settled(stack)
        (line,) = await stack.journal()
        assert line["status"] == 504 and line["cause"] == "silence"


async def test_metadata_chunks_keep_a_quiet_stream_alive(make_stack: StackFactory) -> None:
    async with make_stack(engine={"decode_read_timeout_s": 0.3}) as stack:
        arm(
            stack.engine("d0"),
            phase="decode",
            silence_after=2,
            silence_s=0.8,
            silence_metadata=True,
        )
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200 and "error" not in text
        assert len([p for p in sse_payloads(text) if p["choices"][0]["text"]]) == 8


async def test_without_a_read_timeout_the_request_deadline_bounds_the_stream(
    make_stack: StackFactory,
) -> None:
    async with make_stack(
        engine={
            "decode_read_timeout_s": 0.0,
            "first_token_timeout_s": 0.5,
            "prefill_timeout_s": 0.5,
        },
        serving={"request_timeout_s": 0.8, "queue_timeout_s": 0.5},
    ) as stack:
        arm(stack.engine("d0"), phase="decode", silence_after=2, silence_s=5)
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200
        error = terminal_error(text)
        assert error["code"] == 504
        assert "deadline of 0.8 s" in error["message"]
        assert "while relaying tokens" in error["message"]
        await settled(stack)


async def test_a_stream_closed_before_done_is_an_engine_failure(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", close_after=3)
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200
        error = terminal_error(text)
        assert error["code"] == 502 and "engine d0" in error["message"]
        arm(stack.engine("d0"), phase="decode", close_after=3)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        await settled(stack)


async def test_done_before_any_token_is_502_with_the_exact_message(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", done_before_token=True)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 502
        assert body["error"]["message"] == "stream ended with [DONE] before any token arrived"
        await settled(stack)


async def test_an_error_object_mid_stream_keeps_its_own_status(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", error_after=2, error_code=503)
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200
        error = terminal_error(text)
        assert error["code"] == 503 and "engine d0 reported an error" in error["message"]
        await settled(stack)


async def test_an_error_object_before_output_is_an_http_error_with_its_status(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", error_after=0, error_code=503)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 503 and body["error"]["code"] == 503
        await settled(stack)


@pytest.mark.parametrize(
    ("defect", "fragment"),
    [
        ("missing_engine_id", "remote_engine_id is missing"),
        ("non_integer_block_ids", "remote_block_ids is not a list of non-negative integers"),
        ("negative_block_ids", "remote_block_ids is not a list of non-negative integers"),
    ],
)
async def test_a_malformed_descriptor_is_502_and_no_decode_is_sent(
    make_stack: StackFactory, defect: str, fragment: str
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", descriptor=defect)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 502
        message = body["error"]["message"]
        assert message.startswith("engine p0 sent a bad handoff descriptor") and fragment in message
        assert len(stack.engine("d0").received) == 0
        state = await settled(stack)
        p0 = state["engines"][0]
        assert p0["failures"] == {"descriptor": 1} and p0["streak"] == 1


async def test_a_failed_kv_pull_surfaces_as_the_consumers_error(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", kv_pull_fail=True)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 500
        assert "engine d0 reported an error" in body["error"]["message"]
        await settled(stack)
