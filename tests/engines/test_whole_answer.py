"""A whole decode answer: kept byte for byte, read only for what the router decides on."""

from __future__ import annotations

import pytest

from narwhal.engines.whole_answer import parse_whole_answer
from narwhal.protocol.errors import Cause, NarwhalError


def test_the_answer_is_kept_as_sent_and_its_usage_read() -> None:
    raw = (
        b'{"id":"cmpl-1", "choices": [ {"text":"hi"} ],'
        b'"usage":{"prompt_tokens":5,"completion_tokens":2}}'
    )
    answer = parse_whole_answer(raw, "d0")
    assert answer.body is raw and answer.engine == "d0"
    assert (answer.prompt_tokens, answer.completion_tokens) == (5, 2)


@pytest.mark.parametrize("usage", [b"", b',"usage":null', b',"usage":{"completion_tokens":true}'])
def test_an_answer_without_usable_usage_still_goes_out(usage: bytes) -> None:
    answer = parse_whole_answer(b'{"choices":[]' + usage + b"}", "d0")
    assert answer.completion_tokens is None and answer.prompt_tokens is None


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'"text"'])
def test_an_answer_that_is_not_a_json_object_is_the_engines_fault(raw: bytes) -> None:
    with pytest.raises(NarwhalError) as raised:
        parse_whole_answer(raw, "d0")
    assert raised.value.cause is Cause.BAD_RESPONSE and raised.value.status == 502
    assert raised.value.engine == "d0" and raised.value.transient


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b'{"error":{"message":"overloaded","type":"x","param":null,"code":503}}', 503),
        (b'{"object":"error","message":"broken","code":500}', 500),
    ],
)
def test_an_error_object_in_a_200_keeps_its_status(raw: bytes, status: int) -> None:
    with pytest.raises(NarwhalError) as raised:
        parse_whole_answer(raw, "d0")
    assert raised.value.cause is Cause.ERROR_OBJECT and raised.value.status == status
