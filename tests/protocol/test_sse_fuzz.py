"""Whatever bytes an engine sends, in whatever pieces, the decoder and classifier either
decode them or refuse them with `SseError`; they never fail any other way, and the relay's
fast path decodes exactly what the general decoder does."""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.protocol.sse import (
    SseDecoder,
    SseError,
    classify,
    classify_after_first_output,
    error_status,
)

# Lines that steer the decoder into each of its paths.
LINES = [
    b'data: {"choices":[{"text":"a"}]}',
    b'data:{"choices":[{"text":"b"}]}',
    b'data: {"choices":[],"usage":{"completion_tokens":1}}',
    b'data: {"error":{"code":"x"}}',
    b"data: [DONE]",
    b"data: {",
    b"data: }",
    b"data",
    b": comment",
    b"event: x",
    b"id: 1",
    b"\xff\xfe",
]
ENDS = [b"\n", b"\r", b"\r\n"]


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """Events of a few lines each; half the streams use LF alone, as the fast path wants."""
    ends = ENDS if draw(st.booleans()) else [b"\n"]
    line = st.sampled_from(LINES) | st.binary(max_size=4).filter(lambda b: b"\r" not in b)
    stream = b""
    for _ in range(draw(st.integers(0, 10))):
        lines = draw(st.lists(line, min_size=1, max_size=3))
        for text in [*lines, b""]:
            stream += text + draw(st.sampled_from(ends))
    return stream


cuts = st.lists(st.integers(min_value=0, max_value=400), max_size=8)


def pieces(stream: bytes, at: list[int]) -> list[bytes]:
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in at)})
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def general(parts: list[bytes], max_event_bytes: int) -> list[bytes] | None:
    """Event data through `feed` alone; None when refused."""
    decoder = SseDecoder(max_event_bytes)
    try:
        return [event.data for part in parts for event in decoder.feed(part)]
    except SseError:
        return None


def relayed(parts: list[bytes], max_event_bytes: int) -> list[bytes] | None:
    """Event data as the relay sees it: plain blocks first, the rest through `feed`."""
    decoder = SseDecoder(max_event_bytes)
    data: list[bytes] = []
    try:
        for part in parts:
            block = decoder.feed_plain(part)
            data += [event.data for event in SseDecoder(1 << 30).feed(block)]
            if decoder.ready():
                data += [event.data for event in decoder.feed(b"")]
    except SseError:
        return None
    return data


@settings(max_examples=300)
@given(stream=streams(), at=cuts, small=st.booleans())
def test_any_bytes_in_any_pieces_decode_the_same_on_the_fast_path_or_are_refused(
    stream: bytes, at: list[int], small: bool
) -> None:
    limit = 16 if small else 1 << 20
    parts = pieces(stream, at)
    fast = relayed(parts, limit)
    slow = general(parts, limit)
    if fast is not None and slow is not None:
        assert fast == slow


@settings(max_examples=200)
@given(data=streams() | st.binary(max_size=40))
def test_any_event_is_classified_or_refused_with_sse_error(data: bytes) -> None:
    for decide in (classify, classify_after_first_output):
        with contextlib.suppress(SseError):
            decide(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
keys = st.sampled_from(["error", "object", "choices", "usage", "code", "message", "text"])
payloads = st.dictionaries(keys, json_values, max_size=4)


@given(payload=st.dictionaries(keys, payloads | json_values, max_size=4))
def test_any_error_object_gets_a_status_from_400_to_599_and_a_message(
    payload: dict[str, object],
) -> None:
    status, message = error_status(payload)
    assert 400 <= status <= 599 and isinstance(message, str)
