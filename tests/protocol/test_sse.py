"""SSE decoding and event classification, exhaustively over framings and split points."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.protocol.sse import (
    EventKind,
    SseDecoder,
    SseError,
    block_payloads,
    classify,
    classify_after_first_output,
    error_status,
    reports_tokens,
)

PAYLOADS = [b'{"choices":[{"text":" a"}]}', b'{"choices":[{"text":" b"}]}', b"[DONE]"]


def frame(payloads: list[bytes], newline: bytes) -> bytes:
    return b"".join(b"data: " + p + newline + newline for p in payloads)


def decode_all(chunks: list[bytes]) -> list[bytes]:
    decoder = SseDecoder()
    out: list[bytes] = []
    for chunk in chunks:
        out.extend(event.data for event in decoder.feed(chunk))
    return out


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_yields_the_same_events(newline: bytes) -> None:
    stream = frame(PAYLOADS, newline)
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            assert decode_all([stream[:i], stream[i:j], stream[j:]]) == PAYLOADS


@given(
    payloads=st.lists(
        st.binary(min_size=1, max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b),
        max_size=8,
    ),
    newline=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_any_framing_and_chunking_round_trips(
    payloads: list[bytes], newline: bytes, cuts: list[int]
) -> None:
    stream = frame(payloads, newline)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode_all(chunks) == payloads


def test_raw_bytes_are_kept_for_forwarding() -> None:
    stream = b"data: {}\r\n\r\n: comment\nid: 7\ndata: x\n\n"
    events = SseDecoder().feed(stream)
    assert [e.raw for e in events] == [b"data: {}\r\n\r\n", b": comment\nid: 7\ndata: x\n\n"]
    assert b"".join(e.raw for e in events) == stream


def test_multi_line_data_is_joined_with_newlines() -> None:
    assert decode_all([b"data: a\ndata:b\ndata\n\n"]) == [b"a\nb\n"]


def test_events_without_data_dispatch_nothing() -> None:
    assert decode_all([b": keep-alive\n\n\n\nevent: x\n\n"]) == []


def test_a_cr_ending_a_line_waits_for_a_possible_lf() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert [e.data for e in decoder.feed(b"\ndata: b\n\n")] == [b"a\nb"]


def test_a_cr_ending_an_event_dispatches_it_and_absorbs_the_lf_after() -> None:
    decoder = SseDecoder()
    assert [e.data for e in decoder.feed(b"data: a\r\n\r")] == [b"a"]
    assert [e.data for e in decoder.feed(b"\ndata: b\r\n\r\n")] == [b"b"]


def test_an_event_that_never_ends_is_refused_past_the_limit() -> None:
    decoder = SseDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 50)
    with pytest.raises(SseError, match="exceeded 64 bytes"):
        decoder.feed(b"x" * 50)


def test_done_is_its_own_kind() -> None:
    assert classify(b"[DONE]").kind is EventKind.DONE


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        ({"choices": [{"index": 0, "text": " hi", "finish_reason": None}]}, EventKind.OUTPUT),
        ({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, EventKind.OUTPUT),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, EventKind.METADATA),
        ({"choices": [{"delta": {"content": "x"}}]}, EventKind.OUTPUT),
        ({"choices": [{"delta": {"reasoning": "think"}}]}, EventKind.OUTPUT),
        ({"choices": [{"delta": {"reasoning_content": "think"}}]}, EventKind.OUTPUT),
        ({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}, EventKind.OUTPUT),
        ({"choices": [], "usage": {"completion_tokens": 3}}, EventKind.USAGE),
        ({"choices": []}, EventKind.METADATA),
        ({"error": {"message": "boom", "code": 500}}, EventKind.ERROR),
        ({"object": "error", "message": "old", "code": 503}, EventKind.ERROR),
    ],
)
def test_classification_of_contract_chunks(payload: dict[str, object], kind: EventKind) -> None:
    assert classify(orjson.dumps(payload)).kind is kind


# Chunks as vLLM 0.32 streams them for tokens whose text is empty.
EMPTY_TOKENS = [
    # A skipped special token or part of a multi-byte character, completions and chat.
    {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None}]},
    # A parser holding text back while the token's logprobs or ids go out.
    {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": []}}]},
    {"choices": [{"index": 0, "delta": {}, "token_ids": [7]}]},
    # An unknown field of a future version.
    {"choices": [{"index": 0, "delta": {"future": None}}]},
    # The role announcement and a token in one delta.
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}}]},
    {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": "length"}]},
]


@pytest.mark.parametrize("payload", EMPTY_TOKENS)
def test_every_choice_but_the_role_announcement_reports_generated_tokens(
    payload: dict[str, object],
) -> None:
    assert reports_tokens(payload["choices"][0])  # type: ignore[index]
    assert classify(orjson.dumps(payload)).kind is EventKind.OUTPUT


def test_the_role_announcement_reports_no_token_whatever_else_it_carries_empty() -> None:
    for delta in ({"role": "assistant", "content": ""}, {"role": "assistant"}):
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        assert not reports_tokens(choice)


@pytest.mark.parametrize("data", [b"not json", b"[1,2]", b'{"id": "x"}', b'{"choices": 3}'])
def test_events_that_are_not_chunks_are_refused(data: bytes) -> None:
    with pytest.raises(SseError):
        classify(data)


def test_after_output_only_decisions_are_classified_and_the_rest_must_be_json() -> None:
    assert classify_after_first_output(b'{"choices":[{"text":" x"}]}') is None
    error = classify_after_first_output(b'{"error": {"message": "m", "code": 503}}')
    assert error is not None and error.kind is EventKind.ERROR
    usage = classify_after_first_output(b'{"choices":[],"usage":{"completion_tokens":2}}')
    assert usage is not None and usage.kind is EventKind.USAGE
    for garbage in (b"garbage", b"{not json}", b"[1]"):
        with pytest.raises(SseError):
            classify_after_first_output(garbage)


def test_generated_text_mentioning_error_is_not_an_error_object() -> None:
    data = orjson.dumps({"choices": [{"text": 'the "error" word'}]})
    assert classify_after_first_output(data) is None


def test_error_status_reads_both_shapes() -> None:
    assert error_status({"error": {"message": "m", "code": 503}}) == (503, "m")
    assert error_status({"object": "error", "message": "old", "code": 400}) == (400, "old")
    assert error_status({"error": {"message": "m", "code": "x"}}) == (500, "m")
    assert error_status({"error": {"message": "m", "code": 99}}) == (500, "m")
    assert error_status({"error": "plain"}) == (500, "plain")


def test_a_choice_that_is_not_an_object_reports_no_token() -> None:
    assert not reports_tokens("text")
    assert not reports_tokens(None)


def test_plain_blocks_are_forwarded_whole_and_partial_events_kept() -> None:
    decoder = SseDecoder()
    a, b = b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n'
    assert decoder.feed_plain(a + b + b'data: {"choices":[{"te') == a + b
    assert decoder.feed_plain(b'xt":"c"}]}') == b""
    assert decoder.feed_plain(b"\n\n") == b'data: {"choices":[{"text":"c"}]}\n\n'
    assert decoder.pending == 0


@pytest.mark.parametrize(
    "chunk",
    [
        b'data: {"choices":[{"text":"a"}]\n\n',
        b'data: {"choices":[{"text":"a"}]},{"x":1}\n\n',
        b'data: {"choices":[]}\n\n',
        b'data: {"error": {"code": 500}}\n\n',
        b'data: {"choices":[],"usage":{}}\n\n',
        b"data: [DONE]\n\n",
        b'data: {"a":1}\r\n\r\n',
        b'data: {"a":1}\n: comment\n\n',
        b"data: not json\n\n",
        b'event: x\ndata: {"a":1}\ndata: {"b":1}\n\n',
    ],
)
def test_anything_needing_a_decision_is_left_to_feed(chunk: bytes) -> None:
    decoder = SseDecoder()
    assert decoder.feed_plain(chunk) == b""
    assert decoder.ready()
    assert decoder.feed(b"")
    assert decoder.pending == 0


def test_the_plain_run_before_a_decision_is_relayed_whole() -> None:
    decoder = SseDecoder()
    plain = b'data: {"choices":[{"text":" a"}]}\n\n' * 3
    tail = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n'
    assert decoder.feed_plain(plain + tail) == plain
    assert decoder.ready()
    assert [e.data for e in decoder.feed(b"")] == [tail[6:-16], b"[DONE]"]


@given(
    events=st.lists(
        st.sampled_from(
            [
                b'data: {"choices":[{"text":" x"}]}\n\n',
                b'data: {"choices":[{"text":"data: {"}]}\n\n',
                b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n',
                b": keep-alive\n\n",
                b"data: [DONE]\n\n",
            ]
        ),
        max_size=12,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=6),
)
def test_the_fast_path_never_changes_what_is_decoded(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    fast, slow = SseDecoder(), SseDecoder()
    via_fast: list[bytes] = []
    for a, b in itertools.pairwise(bounds):
        block = fast.feed_plain(stream[a:b])
        via_fast.extend(e.data for e in SseDecoder().feed(block))
        if fast.ready():
            via_fast.extend(e.data for e in fast.feed(b""))
    assert via_fast == [e.data for e in slow.feed(stream)]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_a_limit_takes_events_one_at_a_time_and_keeps_the_rest(newline: bytes) -> None:
    decoder = SseDecoder()
    stream = frame(PAYLOADS, newline)
    taken = [e.data for e in decoder.feed(stream, limit=1)]
    while True:
        more = decoder.feed(b"", limit=1)
        if not more:
            break
        taken += [e.data for e in more]
    assert taken == PAYLOADS and decoder.pending == 0


def test_events_kept_by_a_limit_are_not_mistaken_for_an_oversized_event() -> None:
    event = b'data: {"choices":[{}]}\n\n'
    decoder = SseDecoder(max_event_bytes=32)
    events = decoder.feed(event * 10, limit=1)
    assert len(events) == 1 and decoder.feed_plain(b"") == event * 9


def test_a_plain_block_parses_to_its_payloads() -> None:
    chunks = [{"choices": [{"text": f" {i}\n\ndata: x"}]} for i in range(5)]
    block = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    assert block_payloads(block) == chunks


@pytest.mark.parametrize(
    "block",
    [
        b'data: {"choices":[]}\r\n\r\ndata: [DONE]\r\n\r\n',
        b'data: {"choices":\ndata: []}\n\n',
        b': note\ndata: {"choices":[]}\n\n',
    ],
)
def test_other_framings_parse_event_by_event(block: bytes) -> None:
    assert block_payloads(block) == [{"choices": []}]


def test_a_block_with_a_broken_event_is_refused() -> None:
    with pytest.raises(SseError):
        block_payloads(b'data: {"a":1}\n\ndata: {"b":\n\n')


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"choices":[{"text":"\xff"}]}\n\n',
        b'data: {"choices":[{"text":"a"}],"x":{bad}}\n\n',
        b'data: {"choices":[{"text":"a"}]},{"choices":[{"text":"b"}]}\n\n',
    ],
)
def test_a_block_is_plain_only_if_every_event_is_one_valid_json_object(bad: bytes) -> None:
    good = b'data: {"choices":[{"text":"a"}]}\n\n'
    decoder = SseDecoder()
    assert decoder.feed_plain(good + bad + good) in (good, b"")
    assert decoder.ready()
    assert [e.raw for e in decoder.feed(b"")][-2:] == [bad, good]
