"""Raw member spans: the bytes found are exactly the producer's, and parse to the member."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from narwhal.protocol.jsonspan import first_element_span, member_occurrences, member_spans

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(
    st.dictionaries(st.text(), json_values, max_size=6),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]),
)
def test_each_member_span_parses_to_that_member(
    document: dict[str, Any], separators: tuple[str, str]
) -> None:
    raw = json.dumps(document, separators=separators, ensure_ascii=False).encode()
    spans = member_spans(raw)
    assert spans.keys() == document.keys()
    for key, (start, end) in spans.items():
        assert json.loads(raw[start:end]) == document[key]


def test_the_span_is_the_producers_bytes_verbatim() -> None:
    raw = b'{"id": "x", "kv_transfer_params" : {"b": 1.50, "a": "\\u00e9"} , "z": null}'
    start, end = member_spans(raw)["kv_transfer_params"]
    assert raw[start:end] == b'{"b": 1.50, "a": "\\u00e9"}'


def test_strings_with_brackets_do_not_confuse_the_scan() -> None:
    raw = b'{"a": "}]{[\\"", "b": [1, {"c": "]"}], "d": 2}'
    spans = member_spans(raw)
    assert raw[slice(*spans["b"])] == b'[1, {"c": "]"}]'
    assert raw[slice(*spans["d"])] == b"2"


def test_first_element_of_an_array() -> None:
    raw = b'{"choices": [ {"kv": 1}, {"kv": 2} ]}'
    span = first_element_span(raw, member_spans(raw)["choices"][0])
    assert span is not None and raw[slice(*span)] == b'{"kv": 1}'
    assert first_element_span(b"[ ]", 0) is None


def test_member_occurrences_are_found_at_any_depth_in_one_scan() -> None:
    raw = b'{"a": {"kv": [1, 2]}, "s": "\\"kv\\": 3", "kv" : null}'
    assert [raw[a:b] for a, b in member_occurrences(raw, "kv")] == [b"[1, 2]", b"null"]
    assert member_occurrences(raw, "absent") == []


@given(st.dictionaries(st.text(), json_values, max_size=6))
def test_a_top_level_member_is_found_wherever_it_sits(document: dict[str, Any]) -> None:
    assume('"kv_transfer_params"' not in json.dumps(document))
    document = {**document, "kv_transfer_params": {"remote_block_ids": [1]}}
    raw = json.dumps(document).encode()
    spans = member_occurrences(raw, "kv_transfer_params")
    assert len(spans) == 1
    assert json.loads(raw[slice(*spans[0])]) == {"remote_block_ids": [1]}
