"""Every token vLLM generates reaches the client, including those whose text is empty: a
prompt that is a whole line of the tiny model's corpus is followed by end-of-sequence, and
with `ignore_eos` the end-of-sequence tokens it goes on producing detokenize to "", before
any text. The router relays the same tokens, in the same order, with the same texts."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from real_support import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

BODY = {
    "model": MODEL,
    "prompt": "Red, orange, yellow, green, blue and violet are the colours of the rainbow.",
    "max_tokens": 100,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    "stream": True,
}


async def token_events(url: str) -> list[dict[str, Any]]:
    """The choices of a streamed completion's events, in order (usage and [DONE] aside)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=BODY) as response,
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
    assert sum(len(ids) for _, ids in tokens(routed)) == BODY["max_tokens"]
