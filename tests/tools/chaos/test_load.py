"""The soak's clients: what a stream's end tells them."""

from __future__ import annotations

from narwhal.tools.chaos.load import terminal_code


def test_a_stream_ending_in_an_error_event_has_its_code_and_a_clean_one_none() -> None:
    clean = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    failed = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"code":504}}\n\ndata: [DONE]\n\n'
    assert terminal_code(clean) is None
    assert terminal_code(failed) == 504
