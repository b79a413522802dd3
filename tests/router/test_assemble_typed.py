"""The one-pass typed answer is byte for byte the answer `Assembler` folds from the same
stream, and it declines any stream outside the usual shape instead of guessing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.sse import block_payloads
from narwhal.router.assemble import Assembler, answer_body
from narwhal.router.assemble_typed import gathered_answer, typed_answer

RECORDED = Path(__file__).parent.parent / "data" / "vllm"


def general(
    endpoint: Endpoint,
    block: bytes,
    usage_chunk: dict[str, Any] | None,
    usage: dict[str, Any] | None,
) -> bytes:
    """The answer as the general fold gives it: every event parsed, folded one by one."""
    assembler = Assembler(endpoint)
    for payload in [*block_payloads(block), *([usage_chunk] if usage_chunk else [])]:
        assembler.add(payload)
    if usage is not None:
        assembler.usage = usage
    return orjson.dumps(assembler.result())


def block_of(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks)


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [
        ("completion_stream", Endpoint.COMPLETIONS),
        ("completion_stream_usage", Endpoint.COMPLETIONS),
        ("chat_stream", Endpoint.CHAT),
        ("chat_stream_usage", Endpoint.CHAT),
    ],
)
def test_real_vllm_streams_take_the_typed_pass_and_give_the_same_bytes(
    name: str, endpoint: Endpoint
) -> None:
    events = json.loads((RECORDED / f"{name}.json").read_text())["events"]
    chunks = [event for event in events if event != "[DONE]"]
    # The router asks for usage on its own and holds the usage chunk back.
    usage_chunk = chunks.pop() if not chunks[-1]["choices"] else None
    usage = usage_chunk["usage"] if usage_chunk else None
    block = block_of(chunks)
    typed = typed_answer(endpoint, block, usage_chunk, usage)
    assert typed is not None
    assert typed[0] == general(endpoint, block, usage_chunk, usage)
    assert typed[1] == usage


texts = st.text(alphabet=st.sampled_from(["a", " ", '"', "\\", "\n", "é", "🦄"]), max_size=4)
finishes = st.sampled_from([None, None, None, "stop", "length"])
stop_reasons = st.sampled_from([None, None, "</s>", 7])
# Members outside the usual shape: each must send the stream to the general fold.
UNUSUAL = {
    "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]},
    "token_ids": [5],
    "extra": 1,
    "text": 5,
    "finish_reason": 3,
}
unusual = st.sampled_from([{}, {}, {}, *({key: value} for key, value in UNUSUAL.items())])
USAGE = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


def usual(chunks: list[dict[str, Any]]) -> bool:
    """Whether every chunk keeps to the members and types the typed pass reads."""
    return not any(
        choice.get(key, None) == value
        for chunk in chunks
        for choice in chunk["choices"]
        for key, value in UNUSUAL.items()
    ) and not any(
        "tool_calls" in choice.get("delta", {}) for chunk in chunks for choice in chunk["choices"]
    )


@st.composite
def completion_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    head: dict[str, Any] = {"id": draw(st.sampled_from(["c1", "c2"]))}
    head |= {"object": "text_completion", "created": 5, "model": "m"}
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        choice = {"index": 0, "text": draw(texts), "logprobs": None}
        choice |= {"finish_reason": draw(finishes), "stop_reason": draw(stop_reasons)}
        choice |= {"prompt_token_ids": None, "token_ids": None}
        chunks.append({**head, "choices": [choice | draw(unusual)]})
    if draw(st.booleans()):
        chunks[-1]["system_fingerprint"] = "fp"
    return chunks


@st.composite
def chat_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    chunks = []
    if draw(st.booleans()):
        role = {"role": "assistant", "content": draw(st.sampled_from(["", None, "x"]))}
        choice = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
        chunks.append({**head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None})
    for _ in range(draw(st.integers(1, 6))):
        delta = draw(
            st.sampled_from(["content", "reasoning"]).map(lambda name: {name: ""})
            | st.fixed_dictionaries({"content": texts | st.none()})
            | st.fixed_dictionaries({"reasoning": texts})
            | st.fixed_dictionaries({"role": st.sampled_from(["assistant", None])})
            | st.just({"tool_calls": [{"index": 0, "function": {"name": "f"}}]})
            | st.just({})
        )
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": draw(finishes)}
        if draw(st.booleans()):
            choice |= {"stop_reason": draw(stop_reasons), "token_ids": None}
        chunks.append({**head, "choices": [choice | draw(unusual)]})
    if draw(st.booleans()):
        chunks[-1]["system_fingerprint"] = "fp"
    return chunks


@settings(max_examples=300)
@given(
    st.sampled_from([Endpoint.COMPLETIONS, Endpoint.CHAT]).flatmap(
        lambda e: st.tuples(
            st.just(e), completion_streams() if e is Endpoint.COMPLETIONS else chat_streams()
        )
    ),
    st.sampled_from(["none", "held", "sent"]),
)
def test_the_typed_pass_gives_the_general_folds_bytes_or_declines(
    case: tuple[Endpoint, list[dict[str, Any]]], usage_place: str
) -> None:
    endpoint, chunks = case
    usage_chunk = None
    if usage_place != "none":
        last = {**chunks[0], "choices": [], "usage": USAGE, "system_fingerprint": "fp"}
        last.pop("prompt_token_ids", None)
        last.pop("prompt_text", None)
        if usage_place == "held":
            usage_chunk = last
        else:
            chunks = [*chunks, last]
    usage = USAGE if usage_place == "held" else None
    block = block_of(chunks)
    expected = general(endpoint, block, usage_chunk, usage)
    typed = typed_answer(endpoint, block, usage_chunk, usage)
    if usual(chunks):
        assert typed is not None
        assert typed[0] == expected
    else:
        assert typed is None
    assert answer_body(endpoint, block, usage_chunk, usage)[0] == expected


@settings(max_examples=200)
@given(
    st.sampled_from([Endpoint.COMPLETIONS, Endpoint.CHAT]).flatmap(
        lambda e: st.tuples(
            st.just(e), completion_streams() if e is Endpoint.COMPLETIONS else chat_streams()
        )
    ),
    st.booleans(),
)
def test_a_gathered_stream_gives_the_answer_of_its_events_decided_one_by_one(
    case: tuple[Endpoint, list[dict[str, Any]]], with_usage: bool
) -> None:
    endpoint, chunks = case
    # Decided one by one, the usage chunk is held back and its usage is the stream's.
    usage_chunk = {**chunks[0], "choices": [], "usage": USAGE} if with_usage else None
    usage = USAGE if with_usage else None
    expected = answer_body(endpoint, block_of(chunks), usage_chunk, usage)
    gathered = gathered_answer(
        endpoint, block_of([*chunks, usage_chunk] if usage_chunk else chunks)
    )
    if usual(chunks):
        assert gathered == expected
    else:
        assert gathered is None


def test_a_gathered_stream_with_an_event_without_choices_before_its_last_is_declined() -> None:
    token = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
    metadata = {"id": "c", "object": "text_completion", "choices": []}
    assert gathered_answer(Endpoint.COMPLETIONS, block_of([token, metadata])) is not None
    assert gathered_answer(Endpoint.COMPLETIONS, block_of([token, metadata, token])) is None


@pytest.mark.parametrize(
    "block",
    [
        b'data: {"choices": []}\r\n\r\n',
        b'data: {"choices": []}\n\n: comment\n\n',
        b'data: {"choices": [{"text": "a"}]}{"x": 1}\n\n',
        b"data: [1]\n\n",
        b'data: {"choices": [{"text": "\xff"}]}\n\n',
        b'data: {"choices": [{"text": "a", "logprobs": {"x": []}}]}\n\n',
    ],
)
def test_anything_but_plain_object_events_is_left_to_the_general_fold(block: bytes) -> None:
    assert typed_answer(Endpoint.COMPLETIONS, block, None, None) is None
