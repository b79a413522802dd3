"""Stream continuation on the Responses route: a consumer that fails mid-answer, and the
client still gets one whole response, equal to the uninterrupted one (greedy, on the
simulator), its events numbered without a gap, its conversation kept as one turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from support.stack import MODEL, Stack, StackFactory, arm, settled

pytestmark = pytest.mark.both_lanes

TWO_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
BODY: dict[str, Any] = {
    "model": MODEL,
    "input": "Tell me about whales",
    "max_output_tokens": 24,
    "temperature": 0,
}
FAULTS = {
    "crash": {"crash_after": 7},
    "cut": {"close_after": 7},
    "silence": {"silence_after": 7, "silence_s": 30},
    "error": {"error_after": 7},
}
ENGINE = {"decode_read_timeout_s": 2.0, "first_token_timeout_s": 10.0}
ON = {"enabled": True}


def events(raw: bytes) -> list[dict[str, Any]]:
    """A Responses stream's payloads, each checked against its `event:` line."""
    found = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n", 1)
        payload = orjson.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}", block
        found.append(payload)
    return found


async def ask(stack: Stack, stream: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The response and, streamed, every event the client got."""
    async with stack.http.post(
        stack.url + "/v1/responses", json={**BODY, "stream": stream}
    ) as response:
        assert response.status == 200, await response.text()
        raw = await response.read()
    if not stream:
        return orjson.loads(raw), []
    got = events(raw)
    assert got[-1]["type"] == "response.completed", got[-1]
    return got[-1]["response"], got


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("kind", list(FAULTS))
async def test_a_consumer_failing_mid_answer_is_continued(
    make_stack: StackFactory, tmp_path: Path, kind: str, stream: bool
) -> None:
    async with make_stack(
        TWO_CONSUMERS,
        engine=ENGINE,
        continuation=ON,
        responses={"path": str(tmp_path / "r.sqlite3")},
    ) as stack:
        expected, _ = await ask(stack, stream)
        # An idle fleet places on d0 first (equal loads, list order); d1 takes the rest.
        arm(stack.engine("d0"), phase="decode", times=1, **FAULTS[kind])
        got, streamed = await ask(stack, stream)
        assert text_of(got) == text_of(expected) != ""
        assert got["status"] == expected["status"] == "incomplete"
        assert got["usage"]["output_tokens"] == expected["usage"]["output_tokens"] == 24
        assert got["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
        (message,) = [item for item in got["output"] if item["type"] == "message"]
        if streamed:
            numbers = [event["sequence_number"] for event in streamed]
            assert numbers == list(range(len(streamed)))
            assert len({event["response"]["id"] for event in streamed if "response" in event}) == 1
            deltas = [e for e in streamed if e["type"] == "response.output_text.delta"]
            assert "".join(e["delta"] for e in deltas) == text_of(expected)
            assert {e["item_id"] for e in deltas} == {message["id"]}
            assert [e["type"] for e in streamed].count("response.output_item.added") == 1
            done = [e for e in streamed if e["type"] == "response.output_text.done"]
            assert [e["text"] for e in done] == [text_of(expected)]
        entry = (await stack.journal(2, "request"))[-1]
        assert entry["outcome"] == "ok" and entry["continuations"] == 1, entry
        assert entry["output_tokens"] == 24
        # The response kept is the whole one, under the id the client saw.
        async with stack.http.get(f"{stack.url}/v1/responses/{got['id']}") as kept:
            assert text_of(await kept.json()) == text_of(expected)
        if kind != "crash":
            await settled(stack)


async def test_an_answer_cut_without_continuation_ends_with_the_terminal_event(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(
        TWO_CONSUMERS, engine=ENGINE, responses={"path": str(tmp_path / "r.sqlite3")}
    ) as stack:
        arm(stack.engine("d0"), phase="decode", times=1, close_after=5)
        async with stack.http.post(
            stack.url + "/v1/responses", json={**BODY, "stream": True}
        ) as response:
            got = events(await response.read())
        last = got[-1]
        assert last["type"] == "error" and last["code"] == "502"
        assert last["message"] == (
            "decode stream from engine d0 broke: connection closed before the answer ended"
        )
        assert last["sequence_number"] == got[-2]["sequence_number"] + 1
        entry = (await stack.journal(1, "request"))[-1]
        assert entry["cut"] is True and entry["continuation_refused"] == "continuation is off"
        await settled(stack)
