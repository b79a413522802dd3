"""Non-streaming requests through a router with `engine.nonstream_decode = "whole"`, on the
same real engines: the decode leg goes to vLLM non-streaming, with the descriptor, and its
one answer reaches the client as vLLM wrote it, the same answer the streamed default gives."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import pytest

from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The sea is deep and the whales are"
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is a narwhal?"}],
    "max_tokens": 48,
    "temperature": 0,
}


async def whole_entry(real: RealStack, request_id: str) -> dict[str, Any]:
    assert real.whole_journal_path is not None
    for _ in range(100):
        if real.whole_journal_path.exists():
            for line in real.whole_journal_path.read_text().splitlines():
                entry: dict[str, Any] = json.loads(line)
                if entry.get("client_request_id") == request_id:
                    return entry
        await asyncio.sleep(0.1)
    raise AssertionError(f"no journal line for request {request_id}")


async def post(url: str, route: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + route, json=body, headers={"X-Request-Id": request_id}) as response,
    ):
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("application/json")
        answer: dict[str, Any] = await response.json()
        return answer


async def test_a_whole_completion_is_what_the_streamed_default_answers(real: RealStack) -> None:
    assert real.whole is not None
    request_id = f"whole-{uuid.uuid4().hex[:8]}"
    client = real.whole_openai()
    answer = await client.completions.create(
        **COMPLETION, extra_headers={"X-Request-Id": request_id}
    )
    entry = await whole_entry(real, request_id)
    assert entry["status"] == 200, entry
    assert entry["handoff"] in ("crossed", "fallback", "recomputed")
    expected = await real.openai().completions.create(**COMPLETION)
    assert answer.choices[0].text == expected.choices[0].text
    assert answer.usage is not None
    assert entry["output_tokens"] == answer.usage.completion_tokens
    assert entry["prompt_tokens"] == answer.usage.prompt_tokens
    assert answer.id == f"cmpl-{entry['backend_request_ids'][-1]}"
    assert entry["first_byte_s"] is not None and entry["ttft_s"] <= entry["first_byte_s"]


async def test_a_whole_chat_answer_has_the_members_vllm_gives(real: RealStack) -> None:
    assert real.whole is not None
    request_id = f"whole-{uuid.uuid4().hex[:8]}"
    route = "/v1/chat/completions"
    whole = await post(real.whole.url, route, CHAT, request_id)
    streamed = await post(real.server.url, route, CHAT, f"{request_id}-default")
    alone = await post(real.consumer.url, route, CHAT, f"{request_id}-alone")
    assert list(whole) == list(alone)
    assert list(whole["choices"][0]["message"]) == list(alone["choices"][0]["message"])
    for key in ("content", "reasoning"):
        assert whole["choices"][0]["message"][key] == streamed["choices"][0]["message"][key]
        assert whole["choices"][0]["message"][key] == alone["choices"][0]["message"][key]
    entry = await whole_entry(real, request_id)
    assert entry["status"] == 200 and entry["output_tokens"] == whole["usage"]["completion_tokens"]


async def test_an_engines_refusal_keeps_its_status_and_object(real: RealStack) -> None:
    assert real.whole is not None
    body = {**COMPLETION, "max_tokens": 10**7}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(real.consumer.url + "/v1/completions", json=body) as response:
            direct_status, direct = response.status, await response.json()
        async with http.post(real.whole.url + "/v1/completions", json=body) as response:
            status, routed = response.status, await response.json()
    await real.wait_out_lease()  # the prefill's handoff was never pulled
    assert direct_status == status == 400
    # The consumer's own error object, relayed as sent.
    assert routed["error"] == direct["error"]
