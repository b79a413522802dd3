"""Client bodies in, leg bodies out (CONTRACT.md legs 1 and 2)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.protocol.bodies import (
    ClientRequest,
    Endpoint,
    decode_body,
    parse_client_request,
    prefill_body,
    whole_decode_body,
)
from narwhal.protocol.errors import NarwhalError

MODEL = "m"


def parse(body: Any, endpoint: Endpoint = Endpoint.COMPLETIONS) -> ClientRequest:
    return parse_client_request(endpoint, orjson.dumps(body), MODEL)


def rejected(body: Any, endpoint: Endpoint = Endpoint.COMPLETIONS) -> NarwhalError:
    with pytest.raises(NarwhalError) as info:
        parse(body, endpoint)
    return info.value


def test_a_plain_completion_parses() -> None:
    request = parse({"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True})
    assert request.stream and not request.include_usage and request.max_tokens == 5


def test_include_usage_is_read_from_stream_options() -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert parse(body).include_usage


def test_an_absent_model_means_the_served_one() -> None:
    assert parse({"prompt": "x"}).body["model"] == MODEL


def test_a_named_model_is_kept_for_placement_to_resolve() -> None:
    assert parse({"model": "other", "prompt": "x"}).body["model"] == "other"


def test_a_model_that_is_not_a_string_is_400() -> None:
    error = rejected({"model": 7, "prompt": "x"})
    assert error.status == 400 and "`model` must be a string" in error.message


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": "x", "n": 2}, "`n` > 1 is not supported"),
        ({"prompt": "x", "best_of": 3}, "`best_of` > 1 is not supported"),
        ({"prompt": "x", "n": 0}, "`n` must be a positive integer"),
        ({"prompt": "x", "max_tokens": 0}, "`max_tokens` must be a positive integer"),
        ({"prompt": "x", "max_tokens": True}, "`max_tokens` must be a positive integer"),
        ({"prompt": "x", "stream": "yes"}, "`stream` must be a boolean"),
        ({"prompt": "x", "stream_options": 1}, "`stream_options` must be an object"),
        ({"prompt": ["a", "b"]}, "holds 2 prompts"),
        ({"prompt": 5}, "`prompt` must be"),
        ({"prompt": []}, "a non-empty list of token ids"),
        ({"prompt": [[]]}, "a non-empty list of token ids"),
        ({}, "`prompt` is required"),
        ({"prompt": "x", "model": 3}, "`model` must be a string"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body: Any, fragment: str) -> None:
    error = rejected(body)
    assert error.status == 400 and fragment in error.message


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_streaming_is_400_naming_the_field(stream: bool | None) -> None:
    body: dict[str, Any] = {"prompt": "x", "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    error = rejected(body)
    assert (error.status, error.param) == (400, "stream_options")
    assert "`stream_options`" in error.message and "`stream`" in error.message
    assert error.body()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("options", [None, {}])
def test_empty_stream_options_without_streaming_are_accepted_as_vllm_does(
    options: dict[str, Any] | None,
) -> None:
    assert not parse({"prompt": "x", "stream": False, "stream_options": options}).include_usage


@pytest.mark.parametrize("messages", [None, [], "hi", [{"content": "x"}], [1]])
def test_chat_needs_message_objects_with_roles(messages: Any) -> None:
    error = rejected({"messages": messages}, Endpoint.CHAT)
    assert error.status == 400 and "messages" in error.message


def test_non_json_and_non_object_bodies_are_400() -> None:
    with pytest.raises(NarwhalError, match="not valid JSON"):
        parse_client_request(Endpoint.COMPLETIONS, b"{", MODEL)
    assert "JSON object" in rejected([1]).message


@pytest.mark.parametrize("prompt", ["x", ["x"], [1, 2], [[1, 2]]])
def test_single_prompts_in_any_form_parse(prompt: Any) -> None:
    assert parse({"prompt": prompt}).body["prompt"] == prompt


def test_client_transfer_params_never_survive_parsing() -> None:
    assert "kv_transfer_params" not in parse({"prompt": "x", "kv_transfer_params": {"a": 1}}).body


def test_prefill_body_follows_leg_one() -> None:
    client = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "min_tokens": 3,
        "min_completion_tokens": 3,
        "temperature": 0.5,
    }
    body = orjson.loads(prefill_body(client, crossed=True))
    assert body["stream"] is False
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in body
    assert body["temperature"] == 0.5
    assert body["kv_transfer_params"]["do_remote_decode"] is True


def test_a_same_worker_prefill_requests_no_transfer() -> None:
    body = orjson.loads(prefill_body({"prompt": "x", "kv_transfer_params": {}}, crossed=False))
    assert "kv_transfer_params" not in body and "max_completion_tokens" not in body


def test_decode_body_streams_with_usage_and_splices_the_descriptor_verbatim() -> None:
    descriptor = b'{"remote_engine_id": "e", "remote_block_ids": [1], "x": 1.50}'
    raw = decode_body({"prompt": "x", "max_tokens": 9, "stream": False}, descriptor)
    assert raw.endswith(b',"kv_transfer_params":' + descriptor + b"}")
    body = orjson.loads(raw)
    assert body["stream"] is True and body["max_tokens"] == 9
    assert body["stream_options"] == {"include_usage": True}


def test_a_whole_decode_body_does_not_stream_and_splices_the_descriptor_verbatim() -> None:
    descriptor = b'{"remote_engine_id": "e", "remote_block_ids": [1], "x": 1.50}'
    client = {"prompt": "x", "max_tokens": 9, "kv_transfer_params": {"a": 1}}
    raw = whole_decode_body(client, descriptor)
    assert raw.endswith(b',"kv_transfer_params":' + descriptor + b"}")
    body = orjson.loads(raw)
    assert body["stream"] is False and body["max_tokens"] == 9
    assert "stream_options" not in body
    assert "kv_transfer_params" not in orjson.loads(whole_decode_body(client, None))


def test_decode_body_without_descriptor_has_no_transfer_params() -> None:
    body = orjson.loads(decode_body({"prompt": "x", "kv_transfer_params": {"a": 1}}, None))
    assert "kv_transfer_params" not in body
