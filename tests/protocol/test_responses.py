"""The Responses API sans I/O: the client's body checked, the conversation rebuilt, the legs'
bodies built, each stream event's meaning, and the router's own terminal event."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.descriptor import prefill_request_params
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.protocol.responses import (
    Ask,
    EventError,
    Kind,
    check_responses_body,
    conversation_input,
    decode_body,
    engine_body,
    error_event,
    failure_of,
    input_items,
    kind_of,
    prefill_body,
    read_event,
    response_id,
    status_of,
)

# A producer's descriptor as it wrote it: spacing and key order are its own.
DESCRIPTOR = b'{"remote_engine_id": "e1",  "remote_block_ids": [1, 2,3], "do_remote_prefill":true}'


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def typed(text: str) -> dict[str, Any]:
    """A string input as an item: one user message of one text part."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def rejected(body: dict[str, Any]) -> NarwhalError:
    with pytest.raises(NarwhalError) as info:
        check_responses_body(body)
    return info.value


# The client's body ------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_and_store_defaults_to_true() -> None:
    assert check_responses_body({"input": "hi"}) == Ask(True, None, [typed("hi")])


def test_a_list_input_is_taken_as_its_items() -> None:
    items = [user("a"), said("b"), {"type": "function_call_output", "call_id": "c", "output": ""}]
    ask = check_responses_body(
        {"input": items, "store": False, "previous_response_id": "resp_1", "background": False}
    )
    assert ask == Ask(False, "resp_1", items)
    assert ask.items is items


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "`input` is required"),
        ({"input": None}, "input", "`input` must be a string or a non-empty list of items"),
        ({"input": 3}, "input", "`input` must be a string or a non-empty list of items"),
        ({"input": []}, "input", "`input` must be a string or a non-empty list of items"),
        ({"input": {"role": "user"}}, "input", "`input` must be a string or a non-empty list"),
        ({"input": [user("a"), "b"]}, "input", "`input[1]` must be an object"),
        ({"input": [["x"]]}, "input", "`input[0]` must be an object"),
        ({"input": "x", "store": "yes"}, "store", "`store` must be a boolean"),
        ({"input": "x", "store": 1}, "store", "`store` must be a boolean"),
        ({"input": "x", "store": None}, "store", "`store` must be a boolean"),
        (
            {"input": "x", "previous_response_id": ""},
            "previous_response_id",
            "`previous_response_id` must be a non-empty string",
        ),
        (
            {"input": "x", "previous_response_id": 7},
            "previous_response_id",
            "`previous_response_id` must be a non-empty string",
        ),
        ({"input": "x", "background": True}, "background", "`background` is not supported"),
        ({"input": "x", "background": "no"}, "background", "`background` is not supported"),
        (
            {"input": "x", "max_output_tokens": 0},
            "max_output_tokens",
            "`max_output_tokens` must be a positive integer, got 0",
        ),
        (
            {"input": "x", "max_output_tokens": -3},
            "max_output_tokens",
            "`max_output_tokens` must be a positive integer, got -3",
        ),
        (
            {"input": "x", "max_output_tokens": True},
            "max_output_tokens",
            "`max_output_tokens` must be a positive integer, got True",
        ),
        (
            {"input": "x", "max_output_tokens": 2.0},
            "max_output_tokens",
            "`max_output_tokens` must be a positive integer, got 2.0",
        ),
        (
            {"input": "x", "max_output_tokens": "8"},
            "max_output_tokens",
            "`max_output_tokens` must be a positive integer, got '8'",
        ),
        (
            {"input": "x", "conversation": "conv_1"},
            "conversation",
            "`conversation` is not supported: chain responses with `previous_response_id`",
        ),
        (
            {"input": "x", "conversation": {"id": "conv_1"}},
            "conversation",
            "`conversation` is not supported",
        ),
    ],
)
def test_a_bad_body_is_a_400_naming_its_member(
    body: dict[str, Any], param: str, message: str
) -> None:
    error = rejected(body)
    assert error.status == 400 and error.cause is Cause.BAD_REQUEST
    assert error.param == param
    assert error.message.startswith(message), error.message


def test_the_background_refusal_says_what_to_do_instead() -> None:
    error = rejected({"input": "x", "background": True})
    assert "`stream: true`" in error.message


def test_members_left_null_are_as_absent() -> None:
    body = {
        "input": "x",
        "previous_response_id": None,
        "background": None,
        "max_output_tokens": None,
        "conversation": None,
    }
    assert check_responses_body(body) == Ask(True, None, [typed("x")])


def test_input_items_keeps_a_list_and_wraps_a_string() -> None:
    items = [user("a")]
    assert input_items(items) is items
    assert input_items("") == [typed("")]


def parse(body: dict[str, Any]) -> ClientRequest:
    return parse_client_request(Endpoint.RESPONSES, orjson.dumps(body), "m")


def test_a_responses_body_is_parsed_with_its_ask() -> None:
    request = parse({"input": "hi", "stream": True, "max_output_tokens": 9, "store": False})
    assert request.endpoint is Endpoint.RESPONSES
    assert request.stream and not request.include_usage
    assert request.max_tokens == 9
    assert request.ask == Ask(False, None, [typed("hi")])
    assert request.body["model"] == "m"


def test_a_responses_body_streams_only_when_asked() -> None:
    assert parse({"input": "hi"}).stream is False
    with pytest.raises(NarwhalError) as info:
        parse({"input": "hi", "stream": "yes"})
    assert info.value.status == 400 and info.value.param == "stream"


def test_a_responses_body_is_checked_when_parsed() -> None:
    with pytest.raises(NarwhalError) as info:
        parse({"model": "m", "input": "hi", "background": True})
    assert info.value.status == 400 and info.value.param == "background"


# The conversation -------------------------------------------------------------------------


def test_a_follow_up_gets_every_turn_in_order_then_its_own_items() -> None:
    turns = [
        ([user("one")], [said("1")]),
        ([user("two"), user("two more")], [said("2"), {"type": "reasoning", "summary": []}]),
        ([user("three")], []),
    ]
    whole = conversation_input(turns, [user("four")])
    assert whole == [
        user("one"),
        said("1"),
        user("two"),
        user("two more"),
        said("2"),
        {"type": "reasoning", "summary": []},
        user("three"),
        user("four"),
    ]


def test_a_conversation_without_turns_is_its_own_items() -> None:
    assert conversation_input([], [user("a")]) == [user("a")]


def test_the_rebuild_leaves_the_stored_turns_as_they_were() -> None:
    first_input, first_output = [user("one")], [said("1")]
    conversation_input([(first_input, first_output)], [user("two")])
    assert first_input == [user("one")] and first_output == [said("1")]


def test_the_engines_body_drops_what_the_router_keeps_and_stores_nothing() -> None:
    body = {
        "model": "m",
        "input": "x",
        "previous_response_id": "resp_1",
        "kv_transfer_params": {"do_remote_prefill": True},
        "request_id": "mine",
        "store": True,
        "temperature": 0.5,
        "instructions": "be brief",
    }
    whole = [user("a"), said("b"), user("x")]
    sent = engine_body(body, whole)
    assert sent == {
        "model": "m",
        "input": whole,
        "store": False,
        "temperature": 0.5,
        "instructions": "be brief",
    }
    # The client's body is left as it was (it is the one kept with the response).
    assert body["previous_response_id"] == "resp_1" and body["store"] is True
    assert body["input"] == "x"


def test_the_engines_body_says_store_false_when_the_client_said_nothing() -> None:
    assert engine_body({"input": "x"}, [user("x")]) == {"input": [user("x")], "store": False}


# The legs' bodies ------------------------------------------------------------------------


def test_a_response_is_named_after_its_request_id() -> None:
    assert response_id("abc123") == "resp_abc123"


def test_the_prefill_asks_one_token_whole_and_unstored() -> None:
    body = {"model": "m", "input": [user("x")], "stream": True, "max_output_tokens": 50}
    sent = orjson.loads(prefill_body(body, crossed=False, request_id="resp_r1"))
    assert sent == {
        "model": "m",
        "input": [user("x")],
        "stream": False,
        "store": False,
        "max_output_tokens": 1,
        "request_id": "resp_r1",
    }
    assert body["stream"] is True and body["max_output_tokens"] == 50


def test_a_crossed_prefill_asks_the_producer_to_hold_the_blocks() -> None:
    body = {"input": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    sent = orjson.loads(prefill_body(body, crossed=True, request_id="resp_r1"))
    assert sent["kv_transfer_params"] == prefill_request_params()
    assert sent["max_output_tokens"] == 1 and sent["store"] is False


def test_a_prefill_on_the_consumer_itself_carries_no_kv_transfer_params() -> None:
    body = {"input": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    sent = orjson.loads(prefill_body(body, crossed=False, request_id="resp_r1"))
    assert "kv_transfer_params" not in sent


@pytest.mark.parametrize("stream", [True, False])
def test_the_decode_carries_the_descriptor_byte_for_byte(stream: bool) -> None:
    body = {"model": "m", "input": "x", "kv_transfer_params": {"stale": 1}, "store": True}
    raw = decode_body(body, DESCRIPTOR, request_id="resp_r1", stream=stream)
    assert raw.endswith(b',"kv_transfer_params":' + DESCRIPTOR + b"}")
    assert raw.count(b"kv_transfer_params") == 1
    sent = orjson.loads(raw)
    assert sent["kv_transfer_params"] == orjson.loads(DESCRIPTOR)
    assert sent["stream"] is stream and sent["store"] is False
    assert sent["request_id"] == "resp_r1"
    assert "max_output_tokens" not in sent


def test_a_decode_without_a_descriptor_carries_none() -> None:
    body = {"input": "x", "kv_transfer_params": {"stale": 1}, "max_output_tokens": 7}
    sent = orjson.loads(decode_body(body, None, request_id="resp_r1", stream=True))
    assert sent == {
        "input": "x",
        "max_output_tokens": 7,
        "stream": True,
        "store": False,
        "request_id": "resp_r1",
    }


# The events ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("response.output_text.delta", Kind.OUTPUT),
        ("response.reasoning_text.delta", Kind.OUTPUT),
        ("response.reasoning_summary_text.delta", Kind.OUTPUT),
        ("response.refusal.delta", Kind.OUTPUT),
        ("response.function_call_arguments.delta", Kind.OUTPUT),
        ("response.mcp_call_arguments.delta", Kind.OUTPUT),
        ("response.completed", Kind.ENDED),
        ("response.incomplete", Kind.ENDED),
        ("response.failed", Kind.FAILED),
        ("error", Kind.ERROR),
        ("response.created", Kind.OTHER),
        ("response.in_progress", Kind.OTHER),
        ("response.queued", Kind.OTHER),
        ("response.output_item.added", Kind.OTHER),
        ("response.content_part.added", Kind.OTHER),
        ("response.output_text.done", Kind.OTHER),
        ("response.function_call_arguments.done", Kind.OTHER),
        ("response.output_item.done", Kind.OTHER),
        ("response.delta_seen", Kind.OTHER),
        ("", Kind.OTHER),
    ],
)
def test_each_event_type_has_its_kind(event_type: str, kind: Kind) -> None:
    assert kind_of(event_type) is kind


def test_an_event_is_read_for_its_kind_and_sequence_number() -> None:
    delta = b'{"type":"response.output_text.delta","delta":"hi","sequence_number":4}'
    assert read_event(delta) == (Kind.OUTPUT, 4)
    assert read_event(b'{"type":"response.created","response":{"id":"r"}}') == (Kind.OTHER, None)
    assert read_event('{"type":"error","message":"é"}'.encode()) == (Kind.ERROR, None)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'"response.completed"',
        b"{}",
        b'{"type": 3}',
        b'{"type":"response.output_text.delta","sequence_number":"4"}',
        b'{"type":"response.output_text.delta"} trailing',
        b'{"type":"response.output_text.delta","delta":"\xff"}',
        b'{"type":"response.output_text.delta","extra":[1,}',
        b"",
    ],
)
def test_what_is_not_an_event_is_an_event_error(data: bytes) -> None:
    with pytest.raises(EventError):
        read_event(data)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (400, 400),
        (404, 404),
        (599, 599),
        ("404", 404),
        ("503", 503),
        ("0503", 503),
        (399, None),
        (600, None),
        ("399", None),
        ("600", None),
        (True, None),
        (False, None),
        ("abc", None),
        ("", None),
        ("-404", None),
        (" 404", None),
        (404.0, None),
        (None, None),
        ("server_error", None),
        ("\u00b2", None),
    ],
)
def test_an_errors_code_carries_a_status_only_as_an_integer_in_400_to_599(
    code: object, status: int | None
) -> None:
    assert status_of(code) == status


def test_an_error_events_failure_is_read_from_its_own_members() -> None:
    payload = {
        "type": "error",
        "code": "404",
        "message": "no such model",
        "param": "model",
        "sequence_number": 3,
    }
    assert failure_of(payload) == (404, "no such model", "model")


def test_a_failed_responses_failure_is_read_from_its_error_object() -> None:
    payload = {
        "type": "response.failed",
        "response": {
            "id": "resp_1",
            "status": "failed",
            "error": {"code": 429, "message": "too many", "param": None},
        },
        # The event's own members are not the failure's.
        "code": 400,
        "message": "not this one",
    }
    assert failure_of(payload) == (429, "too many", None)


@pytest.mark.parametrize(
    "payload",
    [
        {"type": "error", "code": "oops", "message": "it broke"},
        {"type": "response.failed", "response": {"error": {"code": "server_error"}}},
        {"type": "response.failed", "response": {"error": None}},
        {"type": "response.failed", "response": "gone"},
        {"type": "response.failed"},
        {"type": "error", "code": 200, "message": "", "param": 5},
    ],
)
def test_a_failure_without_a_status_is_a_502_with_a_message(payload: dict[str, Any]) -> None:
    status, message, param = failure_of(payload)
    assert status == 502 and param is None
    expected = payload.get("message") or "the engine reported a failure"
    assert message == expected


def test_the_routers_terminal_event_is_an_error_event_with_the_next_number() -> None:
    assert error_event(502, "engine d0 closed the stream", None, 8) == (
        b"event: error\n"
        b'data: {"type":"error","code":"502","message":"engine d0 closed the stream",'
        b'"param":null,"sequence_number":8}\n\n'
    )
    assert error_event(400, 'bad "x"', "input", 0) == (
        b"event: error\n"
        b'data: {"type":"error","code":"400","message":"bad \\"x\\"","param":"input",'
        b'"sequence_number":0}\n\n'
    )
