"""Continuation's pure parts: which requests may continue (the eligibility table, row by row)
and the shaping of a replay (ids the client already has are not given twice)."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.continuation import ContinuationConfig
from narwhal.protocol.bodies import ClientRequest, Endpoint
from narwhal.router.continuation import drop_seen, ineligible, tracker


def _chunk(ids: list[int] | None) -> dict[str, Any]:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "token_ids": ids}]}


def test_replayed_ids_the_client_already_has_are_dropped_once() -> None:
    first, second = _chunk([7, 8]), _chunk([9, 10])
    seen = drop_seen(first, [7, 8, 9])
    assert first["choices"][0]["token_ids"] == [] and seen == [9]
    assert drop_seen(second, seen) == []
    assert second["choices"][0]["token_ids"] == [10]


def test_a_replay_that_drew_other_ids_drops_none() -> None:
    # A sampled answer: the replay's token differs from the one the client was given.
    chunk = _chunk([5, 8])
    assert drop_seen(chunk, [7, 8]) == []
    assert chunk["choices"][0]["token_ids"] == [5, 8]


def test_chunks_without_ids_leave_the_overhang_as_it_is() -> None:
    assert drop_seen(_chunk(None), [7]) == [7]
    assert drop_seen({"id": "cmpl-1", "choices": []}, [7]) == [7]


# The eligibility table in `router.continuation`, row by row: a request feature and why it
# cannot continue (None: it may).
ROWS = [
    ("greedy", {"temperature": 0}, None),
    ("sampled", {"temperature": 0.8}, None),
    ("seeded", {"temperature": 0.8, "seed": 7}, None),
    ("per-token rules", {"top_p": 0.9, "top_k": 5, "min_p": 0.1}, None),
    ("logit bias", {"logit_bias": {"5": 1.0}, "allowed_token_ids": [5, 6]}, None),
    ("prompt and output counted", {"repetition_penalty": 1.1, "stop_token_ids": [2]}, None),
    ("ignore eos", {"ignore_eos": True}, None),
    ("output limits", {"min_tokens": 2, "max_completion_tokens": 8}, None),
    ("zero penalties", {"frequency_penalty": 0, "presence_penalty": 0.0}, None),
    ("frequency penalty", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("presence penalty", {"presence_penalty": -0.5}, "presence_penalty"),
    ("stop strings", {"stop": ["\n"]}, "stop strings"),
    ("no stop strings", {"stop": []}, None),
    ("logprobs", {"logprobs": 2}, "logprobs"),
    ("top logprobs", {"top_logprobs": 2}, "logprobs"),
    ("prompt logprobs", {"prompt_logprobs": 1}, "prompt logprobs"),
    ("tools", {"tools": [{"type": "function"}]}, "tool calls"),
    ("tool choice", {"tool_choice": "auto"}, "tool calls"),
    ("functions", {"functions": [{"name": "f"}]}, "tool calls"),
    ("response format", {"response_format": {"type": "json_object"}}, "structured output"),
    ("structured outputs", {"structured_outputs": {"json": {}}}, "structured output"),
    ("guided json", {"guided_json": {}}, "structured output"),
    ("guided regex", {"guided_regex": "a+"}, "structured output"),
    ("guided choice", {"guided_choice": ["a", "b"]}, "structured output"),
    ("guided grammar", {"guided_grammar": "root ::= a"}, "structured output"),
    ("echo", {"echo": True}, "echo"),
    ("no echo", {"echo": False}, None),
    ("suffix", {"suffix": "end"}, "suffix"),
    ("n", {"n": 2}, "n"),
    ("n of one", {"n": 1}, None),
    ("best of", {"best_of": 3}, "best_of"),
    (
        "continuous usage",
        {"stream_options": {"continuous_usage_stats": True}},
        "continuous usage stats",
    ),
    ("usage at the end", {"stream_options": {"include_usage": True}}, None),
    ("prompt truncation", {"truncate_prompt_tokens": 10}, "prompt truncation"),
    ("prompt embeddings", {"prompt_embeds": "AAAA"}, "prompt embeddings"),
    ("bad words", {"bad_words": ["x"]}, "bad_words"),
]


@pytest.mark.parametrize(("feature", "body", "why"), ROWS, ids=[row[0] for row in ROWS])
def test_the_eligibility_table(feature: str, body: dict[str, Any], why: str | None) -> None:
    client_request = ClientRequest(
        Endpoint.COMPLETIONS, {"model": "m", "prompt": "p", **body}, True, False
    )
    assert ineligible(client_request) == why
    on = ContinuationConfig(enabled=True)
    assert (tracker(on, client_request) is None) is (why is not None)


def test_no_request_is_tracked_while_continuation_is_off() -> None:
    client_request = ClientRequest(Endpoint.COMPLETIONS, {"model": "m", "prompt": "p"}, True, False)
    assert tracker(ContinuationConfig(), client_request) is None
    assert tracker(ContinuationConfig(enabled=True, max_attempts=0), client_request) is None
