"""What a client sees through the router is what vLLM 0.32 alone would have answered:
tokens whatever their text, reasoning, every field of an answer, and errors as sent."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from support import COMPLETION, MODEL, StackFactory


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
