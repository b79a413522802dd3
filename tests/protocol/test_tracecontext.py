"""W3C trace context headers: what is accepted, and what is written for an engine leg."""

from __future__ import annotations

import pytest

from narwhal.protocol.tracecontext import (
    MAX_TRACESTATE,
    TraceParent,
    format_traceparent,
    header_lines,
    parse_traceparent,
    passthrough,
    usable_tracestate,
)

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_read() -> None:
    assert parse_traceparent(VALID) == TraceParent(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1
    )


def test_a_later_version_may_carry_more_fields() -> None:
    later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-what-comes-next"
    assert parse_traceparent(later) == TraceParent(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 3
    )


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        VALID + "-extra",  # version 00 has exactly four fields
        VALID.upper(),
        "ff" + VALID[2:],
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        " " + VALID,
    ],
)
def test_an_invalid_traceparent_is_refused(value: str) -> None:
    assert parse_traceparent(value) is None


def test_format_round_trips() -> None:
    found = parse_traceparent(VALID)
    assert found is not None
    assert format_traceparent(*found) == VALID
    assert format_traceparent(1, 2, 0) == "00-" + "0" * 31 + "1-" + "0" * 15 + "2-00"


def test_tracestate_is_passed_within_bounds_only() -> None:
    assert usable_tracestate("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7") is not None
    assert usable_tracestate(None) is None
    assert usable_tracestate("") is None
    assert usable_tracestate("a=" + "b" * MAX_TRACESTATE) is None
    assert usable_tracestate("a=\x01") is None
    assert usable_tracestate("a=é") is None


def test_header_lines_are_ready_to_write() -> None:
    assert header_lines(VALID, None) == f"traceparent: {VALID}\r\n".encode()
    assert header_lines(VALID, "a=b") == f"traceparent: {VALID}\r\ntracestate: a=b\r\n".encode()


def test_passthrough_keeps_a_valid_context_unchanged_and_drops_the_rest() -> None:
    assert passthrough(VALID, "a=b") == header_lines(VALID, "a=b")
    assert passthrough(VALID, None) == header_lines(VALID, None)
    assert passthrough(None, "a=b") == b""
    assert passthrough("garbage", "a=b") == b""
