"""Bad input from engines: whatever an engine answers, the request ends as a correct 502/504,
a terminal error event, or a 200 when the answer was actually valid; the router never crashes
and leaves nothing behind.

A scripted fake engine stands in for each leg, behind the real router over real sockets.
Before the first token every event is parsed; after it a streaming client gets the engine's
events as they were sent (each framed as a JSON object), while a non-streaming answer is
assembled from events that must all parse.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.protocol.sse import SseDecoder
from support.fake_engine import (
    CHAT,
    COMPLETIONS,
    DESCRIPTOR,
    DONE,
    ENGINE_TIMEOUT_S,
    GOOD_PREFILL,
    GOOD_STREAM,
    METADATA,
    TOKENS,
    USAGE,
    Script,
    ask,
    before_first_token,
    chunk,
    event,
    events_of,
    fake_stack,
    journal,
    json_script,
    nothing_left,
    output_of,
    prefill_answer,
    stream,
    terminal_code,
    text_of,
)

# Streams that are actually valid ---------------------------------------------------------

VALID_STREAMS = {
    "lf": stream(),
    "cr": stream(end=b"\r\r"),
    "crlf": stream(end=b"\r\n\r\n"),
    "chat": stream(route=CHAT),
    "metadata, comments and other fields": before_first_token(
        b": keep-alive\n\n", b"event: ping\nid: 7\nretry: 10\n\n", event(METADATA)
    ),
    "done without a space": stream(done=b"data:[DONE]\n\n"),
    "bytes after done": stream(done=DONE + b'data: {"late": true}\n\ngarbage'),
    "a large event": stream(event(chunk("y" * 900_000))),
    "an empty answer": Script(
        (event(METADATA), event(chunk("", finish="stop")), event(USAGE), DONE)
    ),
    "a hundred empty tokens first": before_first_token(*[event(chunk(""))] * 100),
    "a chat stream opening with its role": Script(
        (
            event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            *[event(chunk("", CHAT))] * 3,
            *stream(route=CHAT).pieces,
        )
    ),
}


@pytest.mark.parametrize("name", VALID_STREAMS)
async def test_a_valid_stream_is_relayed_and_assembled_whatever_its_line_ends(
    tmp_path: Path, name: str
) -> None:
    script = VALID_STREAMS[name]
    route = CHAT if "chat" in name else COMPLETIONS
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        streamed = await ask(stack, route, stream=True)
        assert terminal_code(streamed) is None
        sent = [e.data for e in SseDecoder(max_event_bytes=1 << 30).feed(b"".join(script.pieces))]
        sent = sent[: sent.index(b"[DONE]")]
        relayed = events_of(streamed.body)
        assert [e for e in relayed if e != b"[DONE]"] == [e for e in sent if b'"usage"' not in e]
        whole = await ask(stack, route, stream=False)
        assert whole.status == 200
        assert text_of(whole, route) == "".join(output_of(orjson.loads(e), route) for e in sent)
        await nothing_left(stack)


async def test_a_token_with_empty_text_meets_the_first_token_deadline(tmp_path: Path) -> None:
    # Text comes only after the first-token timeout; tokens without text before it.
    empty = [event(chunk(""))] * 8
    script = Script((*empty, *stream().pieces), pause_s=ENGINE_TIMEOUT_S / 6)
    async with fake_stack(tmp_path, GOOD_PREFILL, script, deadline_s=10.0) as stack:
        streamed = await ask(stack, COMPLETIONS, stream=True)
        assert terminal_code(streamed) is None
        assert events_of(streamed.body)[:9] == [orjson.dumps(chunk(""))] * 8 + [
            orjson.dumps(chunk(TOKENS[0]))
        ]
        whole = await ask(stack, COMPLETIONS, stream=False)
        assert whole.status == 200 and text_of(whole, COMPLETIONS) == "".join(TOKENS)
        await nothing_left(stack)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_a_stream_split_at_every_byte_boundary_is_relayed_intact(
    tmp_path: Path, route: str
) -> None:
    script = stream(route=route, end=b"\r\n\r\n").bytewise(pause_s=0.001)
    async with fake_stack(tmp_path, GOOD_PREFILL.bytewise(), script, deadline_s=5.0) as stack:
        streamed = await ask(stack, route, stream=True)
        assert terminal_code(streamed) is None
        # The router read each byte after the first token on its own.
        after_first = len(script.pieces) - len(event(chunk("The", route), b"\r\n\r\n"))
        assert stack.router.router.client.gaps.count >= after_first * 0.9
        texts = [orjson.loads(e)["choices"][0] for e in events_of(streamed.body)[:-1]]
        pieces = [c["text"] if route == COMPLETIONS else c["delta"]["content"] for c in texts]
        assert pieces == list(TOKENS)
        stack.consumer.script = replace(script, pause_s=0.0)
        whole = await ask(stack, route, stream=False)
        assert whole.status == 200 and text_of(whole, route) == "".join(TOKENS)
        await nothing_left(stack)


# Streams that are not ---------------------------------------------------------------------

HUGE = b'data: {"choices": [{"text": "' + b"z" * (1 << 20)


@dataclass(frozen=True)
class Bad:
    """A broken decode stream and how it must end: `status` for a non-streaming request and
    for a stream that fails before its first token, else a terminal event with `status`."""

    script: Script
    status: int
    cause: str
    after_first_token: bool
    route: str = COMPLETIONS


BAD_STREAMS = {
    "oversized event before the first token": Bad(
        Script((event(METADATA), HUGE)), 502, "bad_response", False
    ),
    "oversized event after it": Bad(
        Script((event(chunk("a")), HUGE[:1000]), forever=b"z" * 65536, pause_s=0.0),
        502,
        "bad_response",
        True,
    ),
    "invalid json before the first token": Bad(
        before_first_token(b'data: {"choices": [}\n\n'), 502, "bad_response", False
    ),
    "junk after the first token": Bad(stream(b"data: nope\n\n"), 502, "bad_response", True),
    "not an object after the first token": Bad(stream(event([1, 2])), 502, "bad_response", True),
    "choices not a list before the first token": Bad(
        before_first_token(event({"choices": {"text": "a"}})), 502, "bad_response", False
    ),
    "no choices before the first token": Bad(
        before_first_token(event({"id": "x"})), 502, "bad_response", False
    ),
    "metadata forever before the first token": Bad(
        Script((event(METADATA),), forever=event(METADATA), pause_s=0.01),
        504,
        "first_token_timeout",
        False,
    ),
    "comments forever before the first token": Bad(
        Script((b": hi\n\n",), forever=b": hi\n\n", pause_s=0.01),
        504,
        "first_token_timeout",
        False,
    ),
    "metadata forever after it": Bad(
        Script((event(chunk("a")),), forever=event(METADATA), pause_s=0.01),
        504,
        "deadline",
        True,
    ),
    "silence after the first token": Bad(
        Script((event(chunk("a")),), forever=b"", pause_s=0.05), 504, "silence", True
    ),
    "done before any token": Bad(Script((event(METADATA), DONE)), 502, "done_before_token", False),
    "done with a trailing space": Bad(stream(done=b"data: [DONE] \n\n"), 502, "bad_response", True),
    "done in lower case": Bad(stream(done=b"data: [done]\n\n"), 502, "bad_response", True),
    "done never terminated": Bad(stream(done=b"data: [DONE]"), 502, "closed_early", True),
    "no done, clean close": Bad(stream(done=b""), 502, "closed_early", True),
    "cut mid-event": Bad(
        Script((event(chunk("a")), b'data: {"cho'), cut=True), 502, "closed_early", True
    ),
    "cut before any byte": Bad(Script((), cut=True), 502, "closed_early", False),
    "a json answer instead of a stream": Bad(
        Script((prefill_answer(),), content_type="application/json"),
        502,
        "closed_early",
        False,
    ),
}


@pytest.mark.parametrize("name", BAD_STREAMS)
async def test_a_broken_stream_ends_in_a_502_or_504_or_a_terminal_event(
    tmp_path: Path, name: str
) -> None:
    bad = BAD_STREAMS[name]
    async with fake_stack(tmp_path, GOOD_PREFILL, bad.script) as stack:
        streamed = await ask(stack, bad.route, stream=True)
        if bad.after_first_token:
            assert terminal_code(streamed) == bad.status
        else:
            assert streamed.status == bad.status
            assert streamed.json["error"]["code"] == bad.status
        whole = await ask(stack, bad.route, stream=False)
        assert whole.status == bad.status, whole.body[:300]
        assert whole.json["error"]["code"] == bad.status
        await nothing_left(stack)
        lines = await journal(stack, 2)
        assert [line["cause"] for line in lines] == [bad.cause, bad.cause]


WEIRD_CODES: list[tuple[Any, int]] = [
    ({"error": {"message": "m", "code": "503"}}, 500),
    ({"error": {"message": "m", "code": 200}}, 500),
    ({"error": {"message": "m", "code": 99999}}, 500),
    ({"error": {"message": "m", "code": True}}, 500),
    ({"error": {"message": "m", "code": None}}, 500),
    ({"error": {"message": "m", "code": 503.0}}, 500),
    ({"error": {"message": "m", "code": 429}}, 429),
    ({"error": {"message": 5, "code": 503}}, 503),
    ({"error": "a bare string"}, 500),
    ({"error": [1, 2]}, 500),
    ({"object": "error", "message": "older shape", "code": 503}, 503),
]


@pytest.mark.parametrize(("error", "status"), WEIRD_CODES)
async def test_an_error_object_keeps_a_valid_status_and_any_other_code_is_500(
    tmp_path: Path, error: Any, status: int
) -> None:
    async with fake_stack(tmp_path, GOOD_PREFILL, before_first_token(event(error))) as stack:
        before = await ask(stack, COMPLETIONS, stream=True)
        assert before.status == status and before.json["error"]["code"] == status
        assert isinstance(before.json["error"]["message"], str)
        stack.consumer.script = stream(event(error))
        assert terminal_code(await ask(stack, COMPLETIONS, stream=True)) == status
        assert (await ask(stack, COMPLETIONS, stream=False)).status == status
        await nothing_left(stack)


# Wrong types in known fields --------------------------------------------------------------

WRONG_TYPES = {
    "text a number": (COMPLETIONS, chunk(5)),
    "text a list": (COMPLETIONS, chunk(["a"])),
    "choice not an object": (COMPLETIONS, {"choices": ["a"]}),
    "delta a string": (CHAT, {"choices": [{"index": 0, "delta": "hello"}]}),
    "content an object": (CHAT, chunk({"a": 1}, CHAT)),
    "tool_calls a number": (CHAT, {"choices": [{"index": 0, "delta": {"tool_calls": 5}}]}),
    "tool_calls of junk": (
        CHAT,
        {"choices": [{"index": 0, "delta": {"tool_calls": [1, {"index": "x", "function": 3}]}}]},
    ),
    "finish_reason a list": (COMPLETIONS, chunk("", finish=["x"])),
}


@pytest.mark.parametrize("name", WRONG_TYPES)
async def test_wrongly_typed_fields_are_relayed_as_sent_and_left_out_of_an_assembled_answer(
    tmp_path: Path, name: str
) -> None:
    route, odd = WRONG_TYPES[name]
    async with fake_stack(tmp_path, GOOD_PREFILL, stream(event(odd), route=route)) as stack:
        streamed = await ask(stack, route, stream=True)
        assert terminal_code(streamed) is None
        assert orjson.dumps(odd) in events_of(streamed.body)
        whole = await ask(stack, route, stream=False)
        assert whole.status == 200, whole.body[:300]
        assert text_of(whole, route) == "".join(TOKENS)
        await nothing_left(stack)


@pytest.mark.parametrize("garbage", [b"data: {not json}\n\n", b'data: {"a":1},{"b":2}\n\n'])
async def test_an_event_that_does_not_parse_ends_the_answer_with_a_502(
    tmp_path: Path, garbage: bytes
) -> None:
    script = stream(garbage, event({"no": "choices"}))
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        whole = await ask(stack, COMPLETIONS, stream=False)
        assert whole.status == 502 and "malformed stream" in whole.json["error"]["message"]
        # Streamed, output is already visible: the stream ends with a terminal error event
        # and the garbage never reaches the client.
        streamed = await ask(stack, COMPLETIONS, stream=True)
        assert streamed.status == 200 and terminal_code(streamed) == 502
        assert garbage[6:-2] not in events_of(streamed.body)
        await nothing_left(stack)


# Decode answers that are not a stream -----------------------------------------------------

DECODE_STATUSES: list[tuple[Script, int]] = [
    (json_script(b"<html>oops</html>", 500), 502),
    (json_script(b'{"error": {"message": "prompt too long", "code": 400}}', 400), 400),
    (json_script(b'{"error": "flat"}', 422), 422),
    (json_script(b"x" * (1 << 20), 503), 502),
    (json_script(b"", 401), 502),
    (json_script(b"{}", 504), 504),
]


@pytest.mark.parametrize(("script", "status"), DECODE_STATUSES)
async def test_a_decode_error_status_is_relayed_for_client_faults_and_502_or_504_otherwise(
    tmp_path: Path, script: Script, status: int
) -> None:
    async with fake_stack(tmp_path, GOOD_PREFILL, script) as stack:
        for streaming in (True, False):
            answer = await ask(stack, COMPLETIONS, stream=streaming)
            assert answer.status == status and answer.json["error"]["code"] == status
        await nothing_left(stack)


# Prefill answers --------------------------------------------------------------------------

BAD_PREFILLS: dict[str, tuple[Script, int, str]] = {
    "not json": (json_script(b"<html>"), 502, "bad_response"),
    "a json array": (json_script(b"[1, 2]"), 502, "bad_response"),
    "missing choices": (json_script(b'{"id": "x"}'), 502, "bad_response"),
    "choices not a list": (json_script(prefill_answer(choices={})), 502, "bad_response"),
    "huge": (json_script(b'{"a": "' + b"b" * (9 << 20) + b'"}'), 502, "bad_response"),
    "empty": (json_script(b""), 502, "bad_response"),
    "cut short": (Script((prefill_answer()[:40],), cut=True), 502, "connect"),
    "never finished": (
        Script((prefill_answer()[:40],), forever=b" ", pause_s=0.05),
        504,
        "prefill_timeout",
    ),
    "descriptor a string": (json_script(prefill_answer("abc")), 502, "descriptor"),
    "descriptor a number": (json_script(prefill_answer(5)), 502, "descriptor"),
    "descriptor a list": (json_script(prefill_answer([DESCRIPTOR])), 502, "descriptor"),
    "engine id a number": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_engine_id": 5})),
        502,
        "descriptor",
    ),
    "block ids of strings": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_block_ids": ["1"]})),
        502,
        "descriptor",
    ),
    "block ids with a boolean": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_block_ids": [[1], [True]]})),
        502,
        "descriptor",
    ),
    "block ids a number": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_block_ids": 3})),
        502,
        "descriptor",
    ),
    "host a number": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_host": 5})),
        502,
        "descriptor",
    ),
    "host elsewhere": (
        json_script(prefill_answer({**DESCRIPTOR, "remote_host": "10.9.9.9"})),
        502,
        "descriptor",
    ),
    "error status with junk": (json_script(b"\xff\xfe", 500), 502, "http_status"),
    "client fault status": (
        json_script(b'{"object": "error", "message": "bad field", "code": 400}', 400),
        400,
        "bad_request",
    ),
}


@pytest.mark.parametrize("name", BAD_PREFILLS)
async def test_a_malformed_prefill_answer_fails_the_request_and_no_decode_is_sent(
    tmp_path: Path, name: str
) -> None:
    script, status, cause = BAD_PREFILLS[name]
    async with fake_stack(tmp_path, script, GOOD_STREAM) as stack:
        for streaming in (True, False):
            answer = await ask(stack, COMPLETIONS, stream=streaming)
            assert answer.status == status, answer.body[:300]
            assert answer.json["error"]["code"] == status
        assert stack.consumer.bodies == []
        await nothing_left(stack)
        lines = await journal(stack, 2)
        assert [line["cause"] for line in lines] == [cause, cause]


ODD_BUT_VALID_PREFILLS: dict[str, tuple[Script, object]] = {
    "descriptor null": (json_script(prefill_answer(None)), None),
    "descriptor absent": (json_script(b'{"choices": []}'), None),
    "descriptor inside the first choice": (
        json_script(orjson.dumps({"choices": [{"text": "x", "kv_transfer_params": DESCRIPTOR}]})),
        DESCRIPTOR,
    ),
    "an escaped member name": (json_script(b'{"choice\\u0073": [{"text": "x"}]}'), None),
    "usage of wrong types": (json_script(prefill_answer(usage={"prompt_tokens": "5"})), DESCRIPTOR),
    "split at every byte": (GOOD_PREFILL.bytewise(), DESCRIPTOR),
    "unknown descriptor fields": (
        json_script(prefill_answer({**DESCRIPTOR, "x": [{"y": None}]})),
        {**DESCRIPTOR, "x": [{"y": None}]},
    ),
}


@pytest.mark.parametrize("name", ODD_BUT_VALID_PREFILLS)
async def test_an_odd_but_valid_prefill_answer_hands_off_its_descriptor_or_recomputes(
    tmp_path: Path, name: str
) -> None:
    script, descriptor = ODD_BUT_VALID_PREFILLS[name]
    async with fake_stack(tmp_path, script, GOOD_STREAM) as stack:
        answer = await ask(stack, COMPLETIONS, stream=False)
        assert answer.status == 200, answer.body[:300]
        (decode,) = stack.consumer.bodies
        assert decode.get("kv_transfer_params") == descriptor
        await nothing_left(stack)
