"""Every token vLLM generates reaches the client, including those whose text is empty: with
`ignore_eos`, end-of-sequence tokens detokenize to "" and are still tokens. The router
relays the same tokens, in the same order, with the same texts, however many come before
any text."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_TOKENS = 100
BODY = {
    "model": MODEL,
    "prompt": "Red, orange, yellow, green, blue and violet are the colours of the rainbow.",
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    "stream": True,
}


# The tiny model's tokenizer numbers its special tokens first: <s> 0, </s> 1, <pad> 2.
EOS_ID = "1"
# Only end-of-sequence, a hundred times: a hundred tokens, and not one character of text.
NOTHING_BUT_EOS = {**BODY, "logit_bias": {EOS_ID: 100}}


async def token_events(url: str, body: dict[str, Any] = BODY) -> list[dict[str, Any]]:
    """The choices of a streamed completion's events, in order (usage and [DONE] aside)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        raw = await response.read()
    choices = []
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ")
        if event.startswith(b"data: ") and data != b"[DONE]":
            choices += orjson.loads(data)["choices"]
    return choices


def tokens(choices: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    return [(choice["text"], choice.get("token_ids") or []) for choice in choices]


async def test_empty_text_tokens_are_relayed_like_every_other(real: RealStack) -> None:
    alone = await token_events(real.producer.url)
    routed = await token_events(real.server.url)
    assert any(text == "" for text, _ in tokens(alone)), "the case needs empty-text tokens"
    # vLLM may put several tokens in one event under load: compare the tokens, not events.
    assert [tid for _, ids in tokens(routed) for tid in ids] == [
        tid for _, ids in tokens(alone) for tid in ids
    ]
    assert "".join(text for text, _ in tokens(routed)) == "".join(t for t, _ in tokens(alone))
    assert sum(len(ids) for _, ids in tokens(routed)) == MAX_TOKENS


async def test_a_generation_of_only_empty_text_tokens_arrives_whole(real: RealStack) -> None:
    eos = [int(EOS_ID)] * MAX_TOKENS
    alone = await token_events(real.producer.url, NOTHING_BUT_EOS)
    assert [tid for _, ids in tokens(alone) for tid in ids] == eos
    routed = await token_events(real.server.url, NOTHING_BUT_EOS)
    assert [tid for _, ids in tokens(routed) for tid in ids] == eos
    assert all(text == "" for text, _ in tokens(routed))
