"""A non-streaming answer past its first token: the decode leg is gathered in bulk, not
event by event, and must still end exactly as when every event was decided on arrival.

The engine here writes its events one at a time with pauses between them (so the router
reads them in many reads), behind the real router over real sockets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from support.fake_engine import (
    CHAT,
    COMPLETIONS,
    DONE,
    ENGINE_TIMEOUT_S,
    GOOD_PREFILL,
    USAGE,
    Answer,
    FakeStack,
    Script,
    ask,
    chunk,
    event,
    events_of,
    fake_stack,
    journal,
    nothing_left,
    output_of,
    text_of,
)

PAUSE_S = 0.005
ERROR = {"error": {"message": "the engine ran out of blocks", "code": 503}}


def spaced(route: str, texts: list[str], *tail: bytes, **script: Any) -> Script:
    """One event per token, written apart, then `tail`."""
    pieces = tuple(event(chunk(text, route)) for text in texts)
    return Script((*pieces, *tail), pause_s=script.pop("pause_s", PAUSE_S), **script)


async def outcome(stack: FakeStack, route: str) -> tuple[Answer, dict[str, Any]]:
    answer = await ask(stack, route, stream=False)
    await nothing_left(stack)
    lines = await journal(stack, 1)
    return answer, lines[-1]


async def gaps_counted(stack: FakeStack) -> float:
    async with stack.http.get(stack.url + "/metrics") as response:
        text = await response.text()
    (line,) = [
        line
        for line in text.splitlines()
        if line.startswith("narwhal_inter_token_gap_seconds_count")
    ]
    return float(line.split()[-1])


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_tokens_written_apart_make_the_same_answer_as_the_stream(
    tmp_path: Path, route: str
) -> None:
    texts = [f" w{index}" for index in range(40)]
    script = spaced(route, texts, event(USAGE), DONE)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        streamed = await ask(stack, route, stream=True)
        relayed = [orjson.loads(data) for data in events_of(streamed.body)[:-1]]
        before = await gaps_counted(stack)
        whole = await ask(stack, route, stream=False)
        assert whole.status == 200, whole.body[:300]
        assert text_of(whole, route) == "".join(texts)
        assert "".join(output_of(payload, route) for payload in relayed) == "".join(texts)
        assert whole.json["usage"]["completion_tokens"] == 4
        # The reads after the first token still count as gaps between tokens.
        assert await gaps_counted(stack) > before
        await nothing_left(stack)
        lines = await journal(stack, 2)
        assert [line["status"] for line in lines] == [200, 200]
        assert lines[1]["output_tokens"] == 4


async def test_a_token_that_reads_done_is_text(tmp_path: Path) -> None:
    texts = ["a", " [DONE]", " data: [DONE]", " b"]
    script = spaced(COMPLETIONS, texts, event(USAGE), DONE)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 200 and text_of(answer, COMPLETIONS) == "".join(texts)
        assert line["status"] == 200


async def test_done_and_then_an_engine_that_keeps_the_answer_open_is_a_whole_answer(
    tmp_path: Path,
) -> None:
    # [DONE] split between two writes, then nothing, the answer's body never ended.
    script = spaced(COMPLETIONS, ["a", "b"], event(USAGE), DONE[:9], DONE[9:], forever=b"")
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 200 and text_of(answer, COMPLETIONS) == "ab"
        assert line["status"] == 200


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_an_error_object_among_gathered_tokens_keeps_its_status(
    tmp_path: Path, route: str
) -> None:
    script = spaced(route, ["a", "b", "c"], event(ERROR), DONE)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, route)
        assert answer.status == 503
        message = answer.json["error"]["message"]
        assert "engine d0 reported an error" in message
        assert "the engine ran out of blocks" in message
        assert line["cause"] == "error_object"


async def test_an_error_object_and_then_silence_is_the_error_not_the_silence(
    tmp_path: Path,
) -> None:
    script = spaced(COMPLETIONS, ["a", "b"], event(ERROR), forever=b"", pause_s=0.05)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 503 and line["cause"] == "error_object"


async def test_a_malformed_event_among_gathered_tokens_is_a_502(tmp_path: Path) -> None:
    script = spaced(COMPLETIONS, ["a", "b"], b"data: {nope}\n\n", event(USAGE), DONE)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 502
        assert answer.json["error"]["message"].startswith("engine d0 sent a malformed stream")
        assert line["cause"] == "bad_response"


async def test_a_connection_cut_while_gathering_is_closed_early(tmp_path: Path) -> None:
    script = spaced(COMPLETIONS, ["a", "b", "c"], b'data: {"cho', cut=True)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 502
        assert "decode stream from engine d0" in answer.json["error"]["message"]
        assert line["cause"] == "closed_early"


async def test_an_answer_that_ends_without_done_is_closed_early(tmp_path: Path) -> None:
    script = spaced(COMPLETIONS, ["a", "b", "c"], event(USAGE))
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 502
        assert answer.json["error"]["message"] == (
            "decode stream from engine d0 closed before [DONE]"
        )
        assert line["cause"] == "closed_early"


async def test_a_stall_past_the_read_timeout_while_gathering_is_a_504(tmp_path: Path) -> None:
    script = spaced(COMPLETIONS, ["a", "b", "c"], forever=b"", pause_s=0.05)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 504
        assert answer.json["error"]["message"] == (
            f"engine went silent between tokens: engine d0 sent nothing for {ENGINE_TIMEOUT_S:g} s"
        )
        assert line["cause"] == "silence"


@pytest.mark.parametrize("written", ["at once", "apart"])
async def test_an_answer_past_the_bulk_read_limit_is_whole(tmp_path: Path, written: str) -> None:
    # About 2.5 MiB of events: gathered in several bulk reads of 1 MiB at most.
    texts = [f" {index:05d}" + "x" * 400 for index in range(6000)]
    pieces = [event(chunk(text)) for text in texts]
    if written == "at once":
        script = Script((pieces[0], b"".join(pieces[1:]) + event(USAGE) + DONE))
    else:
        script = Script((*pieces, event(USAGE), DONE), pause_s=0.0)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 200, answer.body[:300]
        assert text_of(answer, COMPLETIONS) == "".join(texts)
        assert line["status"] == 200 and line["output_tokens"] == 4


async def test_an_oversized_event_while_gathering_is_a_502(tmp_path: Path) -> None:
    huge = b'data: {"choices": [{"text": "' + b"z" * (1 << 20)
    script = spaced(COMPLETIONS, ["a", "b"], huge, forever=b"z" * 65536, pause_s=0.0)
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        answer, line = await outcome(stack, COMPLETIONS)
        assert answer.status == 502
        assert "an event exceeded 1048576 bytes without ending" in answer.json["error"]["message"]
        assert line["cause"] == "bad_response"
