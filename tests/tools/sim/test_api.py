"""Request bodies read as vLLM 0.32 reads them: here, the `priority` field and its header.

The messages are those real vLLM 0.32 CPU engines answered (docs/engine-contract.md,
"Request priority"), with and without `--scheduling-policy priority`: the field is validated
the same way whatever the policy.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.tools.sim.api import ApiError, parse_request, request_priority

MODEL = "narwhal-sim"


def _parse(body: dict[str, Any], header: str | None = None, route: str = "completions") -> Any:
    return parse_request(
        orjson.dumps(body),
        "chat" if route == "chat" else "completions",
        model=MODEL,
        max_model_len=1024,
        priority_header=header,
    )


COMPLETION = {"model": MODEL, "prompt": "The sea is deep", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(("route", "body"), [("completions", COMPLETION), ("chat", CHAT)])
def test_both_routes_read_priority_and_default_it_to_zero(route: str, body: dict[str, Any]) -> None:
    assert _parse(body, route=route).priority == 0
    assert _parse(body | {"priority": -3}, route=route).priority == -3
    assert _parse(body | {"priority": 7}, route=route).priority == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [("5", 5), (" 5 ", 5), (1.0, 1), (True, 1), (False, 0), (-(2**63), -(2**63))],
)
def test_priority_is_read_leniently_as_pydantic_reads_an_integer(
    value: object, expected: int
) -> None:
    assert request_priority({"priority": value}) == expected


# What vLLM 0.32 answered (400, type "Bad Request", param "body.priority"), message by message.
REFUSED = [
    (
        1.5,
        "{'type': 'int_from_float', 'loc': 'body.priority', 'msg': 'Input should be a valid "
        "integer, got a number with a fractional part', 'input': '1.5'}",
    ),
    (
        None,
        "{'type': 'int_type', 'loc': 'body.priority', 'msg': 'Input should be a valid "
        "integer', 'input': 'None'}",
    ),
    (
        [1],
        "{'type': 'int_type', 'loc': 'body.priority', 'msg': 'Input should be a valid "
        "integer', 'input': '<list of 1 items>'}",
    ),
    (
        "x",
        "{'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'x'}",
    ),
    (
        2**63,
        "{'type': 'less_than_equal', 'loc': 'body.priority', 'msg': 'Input should be less "
        "than or equal to 9223372036854775807', 'input': '9223372036854775808', "
        "'ctx': {'le': 9223372036854775807}}",
    ),
    (
        -(2**63) - 1,
        "{'type': 'greater_than_equal', 'loc': 'body.priority', 'msg': 'Input should be "
        "greater than or equal to -9223372036854775808', 'input': '-9223372036854775809', "
        "'ctx': {'ge': -9223372036854775808}}",
    ),
]


@pytest.mark.parametrize(("value", "detail"), REFUSED)
def test_a_priority_that_is_not_a_64_bit_integer_is_vllms_validation_error(
    value: object, detail: str
) -> None:
    with pytest.raises(ApiError) as caught:
        # orjson reads an integer below -2**63 as a float: that one is given as parsed.
        if isinstance(value, int) and value < -(2**63):
            request_priority({"priority": value})
        else:
            _parse(CHAT | {"priority": value}, route="chat")
    assert caught.value.to_json() == {
        "error": {
            "message": f"1 validation error:\n  {detail}",
            "type": "Bad Request",
            "param": "body.priority",
            "code": 400,
        }
    }


def test_the_field_is_validated_before_the_model_is_looked_up() -> None:
    with pytest.raises(ApiError) as caught:
        _parse(COMPLETION | {"model": "nope", "priority": 1.5})
    assert (caught.value.status, caught.value.param) == (400, "body.priority")


def test_the_header_wins_over_the_body_when_it_is_an_integer() -> None:
    assert _parse(COMPLETION | {"priority": 3}, header="-7").priority == -7
    assert _parse(COMPLETION, header=" 4 ").priority == 4
    # Not an integer: vLLM falls back to the body, without an error.
    assert _parse(COMPLETION | {"priority": 3}, header="abc").priority == 3
    assert _parse(COMPLETION | {"priority": 3}, header="1.5").priority == 3


def test_a_bad_body_priority_is_refused_even_with_a_good_header() -> None:
    with pytest.raises(ApiError):
        _parse(COMPLETION | {"priority": "x"}, header="2")
