"""The prefill answer's descriptor is the producer's own bytes, wherever the rules find it."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.engines.prefill_answer import _scanned_descriptor, parse_prefill_answer
from narwhal.protocol.errors import Cause, NarwhalError

DESCRIPTOR = b'{"do_remote_prefill": true,  "remote_block_ids": [1, 2,3], "remote_host": "h"}'


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"choices": [], "kv_transfer_params": ' + DESCRIPTOR + b"}", DESCRIPTOR),
        (b'{"choices": [{"kv_transfer_params": ' + DESCRIPTOR + b"}]}", DESCRIPTOR),
        (b'{"choices": [], "kv_transfer_params": null}', None),
        (b'{"choices": [{"text": "kv_transfer_params"}]}', None),
        (b'{"choices": [{"text": "\\"kv_transfer_params\\": 1"}]}', None),
        (
            b'{"choices": [{"kv_transfer_params": {"a": 1}}], "kv_transfer_params": '
            + DESCRIPTOR
            + b"}",
            DESCRIPTOR,
        ),
        (b'{"choices": [], "metrics": {"kv_transfer_params": ' + DESCRIPTOR + b"}}", DESCRIPTOR),
    ],
)
def test_the_descriptor_is_taken_byte_for_byte_from_where_the_rules_find_it(
    raw: bytes, expected: bytes | None
) -> None:
    assert parse_prefill_answer(raw, "p") == (expected, None)


def test_the_prompt_size_is_read_only_from_an_integer() -> None:
    answer = b'{"choices": [], "usage": {"prompt_tokens": %s}}'
    assert parse_prefill_answer(answer % b"12", "p") == (None, 12)
    assert parse_prefill_answer(answer % b"true", "p") == (None, None)
    assert parse_prefill_answer(answer % b'"12"', "p") == (None, None)
    assert parse_prefill_answer(b'{"choices": [], "usage": 3}', "p") == (None, None)


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b'{"choices": {}}',
        b'{"id": "x"}',
        b'{"choices": []} trailing',
        b'{"choices": [], "text": "\xff"}',
        b'{"choices": [], "n": NaN}',
        b"",
    ],
)
def test_an_answer_that_is_not_a_completion_is_a_bad_response(raw: bytes) -> None:
    with pytest.raises(NarwhalError) as caught:
        parse_prefill_answer(raw, "p")
    assert caught.value.cause is Cause.BAD_RESPONSE


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)
_placements = st.sampled_from(["top", "choice", "both", "nested", "none", "null"])


@given(_placements, _values, st.booleans())
def test_the_one_pass_read_agrees_with_the_scan_on_any_layout(
    placement: str, value: object, spaced: bool
) -> None:
    descriptor = orjson.dumps(value)
    choice: dict[str, object] = {"index": 0, "text": "x"}
    answer: dict[str, object] = {"id": "c", "choices": [choice]}
    if placement in ("choice", "both"):
        choice["kv_transfer_params"] = {"inner": value}
    if placement in ("top", "both"):
        answer["kv_transfer_params"] = value
    if placement == "nested":
        answer["metrics"] = {"kv_transfer_params": value}
    if placement == "null":
        answer["kv_transfer_params"] = None
    raw = orjson.dumps(answer)
    if spaced:
        raw = raw.replace(b'":', b'": ').replace(b",", b", ")
    found, _ = parse_prefill_answer(raw, "p")
    assert found == _scanned_descriptor(raw)
    if placement == "top" and value is not None and not spaced:
        assert found == descriptor


def responses_answer(descriptor: bytes, usage: bytes = b'{"input_tokens": 12}') -> bytes:
    """A Responses prefill answer (`/v1/responses`) as the producer writes it."""
    return (
        b'{"id": "resp_r1", "object": "response", "status": "incomplete", '
        b'"output": [{"type": "message", "role": "assistant", '
        b'"content": [{"type": "output_text", "text": "H"}]}], '
        b'"usage": ' + usage + b', "kv_transfer_params": ' + descriptor + b"}"
    )


def test_a_responses_answer_gives_its_descriptor_byte_for_byte_and_its_input_tokens() -> None:
    assert parse_prefill_answer(responses_answer(DESCRIPTOR), "p", responses=True) == (
        DESCRIPTOR,
        12,
    )


def test_a_responses_answer_counts_input_tokens_not_prompt_tokens() -> None:
    raw = responses_answer(b"null", b'{"prompt_tokens": 9, "input_tokens": true}')
    assert parse_prefill_answer(raw, "p", responses=True) == (None, None)


def test_a_responses_answer_mentioning_the_member_in_its_text_still_finds_the_descriptor() -> None:
    raw = responses_answer(DESCRIPTOR).replace(b'"text": "H"', b'"text": "kv_transfer_params"')
    assert parse_prefill_answer(raw, "p", responses=True) == (DESCRIPTOR, 12)
    nested = responses_answer(DESCRIPTOR).replace(
        b'"role": "assistant"', b'"role": "assistant", "kv_transfer_params": {"a": 1}'
    )
    assert parse_prefill_answer(nested, "p", responses=True) == (DESCRIPTOR, 12)


def test_a_responses_answer_read_as_a_completion_is_not_a_completion() -> None:
    with pytest.raises(NarwhalError) as caught:
        parse_prefill_answer(responses_answer(DESCRIPTOR), "p")
    assert caught.value.cause is Cause.BAD_RESPONSE and caught.value.status == 502
    assert caught.value.message == "engine p sent a prefill answer that is not a completion"


def test_a_completion_read_as_a_responses_answer_is_a_bad_response() -> None:
    completion = b'{"choices": [], "kv_transfer_params": ' + DESCRIPTOR + b"}"
    with pytest.raises(NarwhalError) as caught:
        parse_prefill_answer(completion, "p", responses=True)
    assert caught.value.cause is Cause.BAD_RESPONSE
