"""What a client sees through the router is what vLLM 0.32 alone would have answered:
tokens whatever their text, reasoning, every field of an answer, and errors as sent."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from support.stack import CHAT, COMPLETION, MODEL, StackFactory


async def test_an_engine_400_reaches_the_openai_client_with_its_param(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"max_model_len": 64}) as stack:
        direct_status, direct = await stack.post_to_engine("p0", "/v1/completions", LONG)
        assert direct_status == 400 and direct["error"]["param"] is not None
        with pytest.raises(openai.BadRequestError) as info:
            await stack.openai().completions.create(**LONG)
        assert info.value.body == direct["error"]


async def test_stream_options_without_streaming_is_refused_naming_the_field(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        body = {**COMPLETION, "stream_options": {"include_usage": True}}
        with pytest.raises(openai.BadRequestError) as info:
            await stack.openai().completions.create(**body)
        error: Any = info.value.body
        assert error["param"] == "stream_options" and error["code"] == 400
        assert "`stream`" in error["message"]
        assert not stack.engine("p0").received


LONG: dict[str, Any] = {"model": MODEL, "prompt": "word " * 100, "max_tokens": 4}


async def test_tokens_without_text_reach_the_client_one_event_each(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"empty_token_probability": 0.5}) as stack:
        client = stack.openai()
        texts = [
            chunk.choices[0].text
            async for chunk in await client.completions.create(
                model=MODEL, prompt="The sea is", max_tokens=16, stream=True
            )
        ]
        assert len(texts) == 16 and "" in texts
        whole = await client.completions.create(model=MODEL, prompt="The sea is", max_tokens=16)
        assert whole.choices[0].text == "".join(texts)


async def test_reasoning_is_relayed_and_assembled_whole(make_stack: StackFactory) -> None:
    async with make_stack(sim={"reasoning_tokens": 3}) as stack:
        client = stack.openai()
        messages: Any = CHAT["messages"]
        deltas = [
            chunk.choices[0].delta
            async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=9, stream=True
            )
        ]
        reasoning = "".join((delta.model_extra or {}).get("reasoning") or "" for delta in deltas)
        content = "".join(delta.content or "" for delta in deltas)
        assert reasoning and content
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
        message = whole.choices[0].message
        assert (message.model_extra or {})["reasoning"] == reasoning
        assert message.content == content


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_an_assembled_answer_is_the_one_vllm_gives_without_streaming(
    make_stack: StackFactory, route: str
) -> None:
    body = COMPLETION if route == "/v1/completions" else {**CHAT, "stop": ["zz"]}
    async with make_stack(sim={"reasoning_tokens": 2, "empty_token_probability": 0.3}) as stack:
        status, routed = await stack.post(route, body)
        assert status == 200
        _, direct = await stack.post_to_engine("d0", route, body)
        different = {"id", "created"}
        assert list(routed) == list(direct)
        assert {k: v for k, v in routed.items() if k not in different} == {
            k: v for k, v in direct.items() if k not in different
        }
