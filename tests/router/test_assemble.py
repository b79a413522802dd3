"""A non-streaming answer assembled from the decode stream is the answer vLLM 0.32 gives
for the same request without streaming: every member, in its order, nothing lost."""

from __future__ import annotations

from typing import Any

from narwhal.protocol.bodies import Endpoint
from narwhal.router.assemble import Assembler

HEAD = {"id": "cmpl-1", "created": 7, "model": "m"}
FINGERPRINT = "vllm-0.32.0-0a1b2c3d"
USAGE = {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}


def completion_chunk(text: str, finish: str | None = None, **choice: Any) -> dict[str, Any]:
    """A completions chunk exactly as vLLM 0.32 streams it."""
    return {
        **HEAD,
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
                **choice,
            }
        ],
    }


def chat_chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    """A chat chunk exactly as vLLM 0.32 streams it."""
    return {
        **HEAD,
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **choice}
        ],
    }


ROLE = chat_chunk({"role": "assistant", "content": ""}) | {
    "prompt_token_ids": None,
    "prompt_text": None,
}


def usage_chunk(kind: str, response_id: str) -> dict[str, Any]:
    """The last chunk when usage was asked for; it carries the fingerprint."""
    return {
        **HEAD,
        "id": response_id,
        "object": kind,
        "choices": [],
        "usage": USAGE,
        "system_fingerprint": FINGERPRINT,
    }


def assembled(endpoint: Endpoint, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    assembler = Assembler(endpoint)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.result()


def test_a_completion_is_vllms_non_streaming_answer_member_for_member() -> None:
    chunks = [
        completion_chunk(" a"),
        completion_chunk(""),
        completion_chunk(" b", "length"),
        usage_chunk("text_completion", "cmpl-1"),
    ]
    answer = assembled(Endpoint.COMPLETIONS, chunks)
    expected: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " a b",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": {**USAGE, "prompt_tokens_details": None, "completion_tokens_details": None},
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    assert answer == expected
    assert list(answer) == list(expected)
    assert list(answer["choices"][0]) == list(expected["choices"][0])


def test_a_chat_answer_is_vllms_non_streaming_answer_member_for_member() -> None:
    chunks = [
        ROLE,
        chat_chunk({"content": " a"}),
        chat_chunk({"content": ""}),
        chat_chunk({"content": " b"}, "stop", stop_reason="</s>", token_ids=None),
        usage_chunk("chat.completion.chunk", "chatcmpl-1"),
    ]
    answer = assembled(Endpoint.CHAT, chunks)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": " a b",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": "</s>",
        "token_ids": None,
        "routed_experts": None,
    }
    assert list(answer) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-1"
    assert answer["choices"] == [choice]
    assert list(answer["choices"][0]["message"]) == list(message)
    assert answer["system_fingerprint"] == FINGERPRINT


def test_reasoning_is_assembled_whole_under_the_name_the_engine_used() -> None:
    for name in ("reasoning", "reasoning_content"):
        chunks = [
            ROLE,
            chat_chunk({name: "Whales"}),
            chat_chunk({name: ""}),
            chat_chunk({name: " sing."}),
            chat_chunk({"content": "Yes."}, "stop"),
        ]
        message = assembled(Endpoint.CHAT, chunks)["choices"][0]["message"]
        assert message[name] == "Whales sing." and message["content"] == "Yes."
        assert ("reasoning_content" in message) is (name == "reasoning_content")


def test_content_stays_null_when_no_token_carried_any() -> None:
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    chunks = [
        ROLE,
        chat_chunk({"tool_calls": [call]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
        chat_chunk({}, "tool_calls"),
    ]
    choice = assembled(Endpoint.CHAT, chunks)["choices"][0]
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert choice["finish_reason"] == "tool_calls"


def test_logprobs_and_token_ids_are_joined_over_the_stream() -> None:
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.5, "bytes": None, "top_logprobs": []}

    chunks = [
        ROLE,
        chat_chunk({"content": "a"}, logprobs={"content": [entry("a")]}, token_ids=[1]),
        chat_chunk({}, logprobs={"content": [entry("")]}, token_ids=[2]),
        chat_chunk({"content": "b"}, "length", logprobs={"content": [entry("b")]}, token_ids=[3]),
    ]
    choice = assembled(Endpoint.CHAT, chunks)["choices"][0]
    assert choice["logprobs"] == {"content": [entry("a"), entry(""), entry("b")]}
    assert choice["token_ids"] == [1, 2, 3]
    first = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": ["a"], "top_logprobs": [None]}
    second = {"text_offset": [1], "token_logprobs": [-0.2], "tokens": [""], "top_logprobs": [None]}
    chunks = [
        completion_chunk("a", logprobs=first, token_ids=[1], prompt_token_ids=[9, 9]),
        completion_chunk("", "length", logprobs=second, token_ids=[2]),
    ]
    choice = assembled(Endpoint.COMPLETIONS, chunks)["choices"][0]
    assert choice["logprobs"] == {
        "text_offset": [0, 1],
        "token_logprobs": [-0.1, -0.2],
        "tokens": ["a", ""],
        "top_logprobs": [None, None],
    }
    assert (choice["token_ids"], choice["prompt_token_ids"]) == ([1, 2], [9, 9])


def test_members_the_router_does_not_know_are_kept_at_every_level() -> None:
    chunks = [
        ROLE | {"future_top": {"x": 1}},
        chat_chunk({"content": "a", "annotation_text": "n"}, future_choice=3),
        chat_chunk({"content": "b", "annotation_text": "o"}, "stop"),
    ]
    answer = assembled(Endpoint.CHAT, chunks)
    assert answer["future_top"] == {"x": 1}
    assert answer["choices"][0]["future_choice"] == 3
    assert answer["choices"][0]["message"]["annotation_text"] == "no"


def test_text_of_another_type_is_left_out() -> None:
    chunks = [completion_chunk("a"), completion_chunk(5), completion_chunk("b", "length")]  # type: ignore[arg-type]
    assert assembled(Endpoint.COMPLETIONS, chunks)["choices"][0]["text"] == "ab"
    chunks = [ROLE, chat_chunk({"content": {"a": 1}}), chat_chunk({"content": "b"}, "stop")]
    assert assembled(Endpoint.CHAT, chunks)["choices"][0]["message"]["content"] == "b"
