"""Non-streaming requests with `engine.nonstream_decode = "whole"`: the consumer's decode is
asked for whole and its one answer forwarded to the client as it came. Over the simulator
with the `openai` client (both client-facing servers), and behind scripted engines for the
answer's exact bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.engines.release import RELEASE_MODEL
from support.fake_engine import (
    COMPLETIONS,
    GOOD_PREFILL,
    ask,
    fake_stack,
    journal,
    json_script,
    nothing_left,
)
from support.stack import (
    CHAT,
    COMPLETION,
    StackFactory,
    arm,
    direct_text,
    settled,
)

pytestmark = pytest.mark.both_lanes

WHOLE = {"nonstream_decode": "whole"}
TWO_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))


def decode_bodies(stack: Any, name: str = "d0") -> list[dict[str, Any]]:
    """The decodes an engine received (not the releases of handoffs another one dropped)."""
    bodies = [received.body for received in stack.engine(name).received]
    return [body for body in bodies if body.get("model") != RELEASE_MODEL]


async def test_a_completion_is_the_consumers_own_answer(make_stack: StackFactory) -> None:
    async with make_stack(engine=WHOLE) as stack:
        client = stack.openai()
        completion = await client.completions.create(**COMPLETION)
        expected = await direct_text(stack.engine("p0").url, "/v1/completions", COMPLETION)
        assert completion.choices[0].text == expected
        (sent,) = decode_bodies(stack)
        assert sent["stream"] is False and "stream_options" not in sent
        assert sent["kv_transfer_params"]["do_remote_prefill"] is True
        (line,) = await stack.journal(1, "request")
        assert line["status"] == 200 and line["handoff"] == "crossed"
        assert completion.id == f"cmpl-{line['backend_request_ids'][0]}"
        assert completion.usage is not None
        assert line["output_tokens"] == completion.usage.completion_tokens
        assert line["prompt_tokens"] == completion.usage.prompt_tokens
        # The first token is the prefill's; the first byte is the whole answer's arrival.
        assert 0 < line["ttft_s"] <= line["first_byte_s"] <= line["duration_s"]
        assert line["abandoned_handoffs"]["count"] == 0
        await settled(stack)


async def test_a_chat_answer_has_every_member_the_engine_alone_gives(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine=WHOLE) as stack:
        status, body = await stack.post("/v1/chat/completions", CHAT)
        _, alone = await stack.post_to_engine("d0", "/v1/chat/completions", CHAT)
        assert status == 200
        assert list(body) == list(alone)
        assert list(body["choices"][0]["message"]) == list(alone["choices"][0]["message"])
        assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert decode_bodies(stack)[0]["stream"] is False
        await settled(stack)


async def test_streaming_requests_and_the_default_still_stream_the_decode(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine=WHOLE) as stack:
        await stack.post("/v1/completions", {**COMPLETION, "stream": True})
        assert decode_bodies(stack)[-1]["stream"] is True
    async with make_stack() as stack:
        await stack.openai().completions.create(**COMPLETION)
        assert decode_bodies(stack)[-1]["stream"] is True


async def test_a_continuable_request_keeps_a_streamed_decode(make_stack: StackFactory) -> None:
    async with make_stack(engine=WHOLE, continuation={"enabled": True}) as stack:
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        (sent,) = decode_bodies(stack)
        assert sent["stream"] is True and sent["return_token_ids"] is True


@pytest.mark.parametrize(("engine_status", "status"), [(503, 502), (504, 504), (400, 400)])
async def test_an_engines_error_answer_keeps_its_status(
    make_stack: StackFactory, engine_status: int, status: int
) -> None:
    async with make_stack(engine=WHOLE) as stack:
        arm(stack.engine("d0"), phase="decode", status=engine_status)
        got, body = await stack.post("/v1/completions", COMPLETION)
        assert got == status
        if engine_status == 400:
            # The client's own fault: the engine's error object as it sent it.
            assert body["error"]["message"] == "simulated fault: HTTP 400"
        else:
            assert (
                f"decode on engine d0 failed with HTTP {engine_status}"
                in (body["error"]["message"])
            )
        await settled(stack)


async def test_an_error_mid_generation_keeps_its_status(make_stack: StackFactory) -> None:
    async with make_stack(engine=WHOLE) as stack:
        arm(stack.engine("d0"), phase="decode", error_after=2, error_code=503)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        (line,) = await stack.journal(1, "request")
        assert line["failures"] == [{"engine": "d0", "cause": "http_status", "status": 502}]
        await settled(stack)


async def test_a_whole_answer_past_its_timeout_is_504_and_abandons_nothing(
    make_stack: StackFactory,
) -> None:
    engine = {**WHOLE, "whole_answer_timeout_s": 0.3}
    async with make_stack(engine=engine) as stack:
        arm(stack.engine("d0"), phase="decode", first_token_delay_s=5)
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 504
        assert body["error"]["message"] == (
            "engine d0 gave no whole answer within 0.3 s (engine.whole_answer_timeout_s)"
        )
        (line,) = await stack.journal(1, "request")
        assert line["cause"] == "first_token_timeout" and line["first_byte_s"] is None
        # The descriptor had gone out: the consumer may have pulled.
        assert line["abandoned_handoffs"]["count"] == 0
        await settled(stack)


async def test_without_its_own_timeout_the_request_deadline_bounds_the_whole_leg(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine=WHOLE, serving={"request_timeout_s": 1.0}) as stack:
        arm(stack.engine("d0"), phase="decode", first_token_delay_s=5)
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 504
        assert body["error"]["message"].startswith("request exceeded its deadline of 1 s")
        await settled(stack)


async def test_a_failed_whole_leg_is_retried_on_another_consumer(
    make_stack: StackFactory,
) -> None:
    serving = {"max_attempts": 2}
    recovery = {"eject_after": 1000}
    async with make_stack(TWO_CONSUMERS, engine=WHOLE, serving=serving, recovery=recovery) as stack:
        arm(stack.engine("d0"), phase="decode", status=503)
        # Placement picks either consumer: ask until one request met d0 first.
        for count in range(1, 21):
            status, body = await stack.post("/v1/completions", COMPLETION)
            assert status == 200, body
            line = (await stack.journal(count, "request"))[-1]
            if line["attempts"] == 2:
                break
        assert line["attempts"] == 2 and line["consumer"] == "d1"
        assert line["failures"] == [{"engine": "d0", "cause": "http_status", "status": 502}]
        assert [body["stream"] for body in decode_bodies(stack, "d1")] == [False] * len(
            decode_bodies(stack, "d1")
        )
        await settled(stack)


# The answer's bytes, behind scripted engines ----------------------------------------------

# Spaced and ordered as no JSON encoder of the router's would write it.
ANSWER = (
    b'{ "id" : "cmpl-fake",  "object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"caf\\u00e9 \xe2\x9c\x93","finish_reason":"length",'
    b'"unknown_member":{"kept":[1.50, 2e3]}}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}\n'
)


async def test_the_client_gets_exactly_the_consumers_answer_bytes(tmp_path: Path) -> None:
    async with fake_stack(tmp_path, GOOD_PREFILL, json_script(ANSWER), engine=WHOLE) as stack:
        answer = await ask(stack, COMPLETIONS, stream=False)
        assert answer.status == 200 and answer.body == ANSWER
        assert stack.consumer.bodies[0]["stream"] is False
        await nothing_left(stack)
        (line,) = await journal(stack, 1)
        assert (line["prompt_tokens"], line["output_tokens"]) == (5, 4)


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"error": {"message": "x", "code": 503}}'])
async def test_a_200_that_is_no_answer_is_the_engines_fault(tmp_path: Path, raw: bytes) -> None:
    async with fake_stack(tmp_path, GOOD_PREFILL, json_script(raw), engine=WHOLE) as stack:
        answer = await ask(stack, COMPLETIONS, stream=False)
        assert answer.status == (503 if b"error" in raw else 502)
        assert orjson.loads(answer.body)["error"]["message"].startswith("engine d0")
        await nothing_left(stack)
