"""The continuation tracker's pure parts: ids spliced out by bytes, read only on failure."""

from __future__ import annotations

import orjson

from narwhal.router.progress import Progress, strip_ids


def _event(
    text: str, ids: list[int], *, prompt: list[int] | None = None, last: bool = False
) -> bytes:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
        "prompt_token_ids": prompt,
        "token_ids": ids,
    }
    return b"data: " + orjson.dumps({"id": "cmpl-1", "choices": [choice]}) + b"\n\n"


def _progress(*, strip: bool = True, max_tracked: int = 100, max_bytes: int = 1 << 20) -> Progress:
    return Progress(chat=False, strip=strip, max_tracked=max_tracked, room=max_bytes)


def test_ids_are_spliced_to_null_and_the_rest_is_untouched() -> None:
    block = _event("a", [5], prompt=[1, 2, 3]) + _event('say "token_ids":[', [6, 7])
    out = strip_ids(block)
    events = [orjson.loads(part[6:]) for part in out.split(b"\n\n") if part]
    choices = [e["choices"][0] for e in events]
    assert [c["token_ids"] for c in choices] == [None, None]
    assert [c["prompt_token_ids"] for c in choices] == [None, None]
    assert [c["text"] for c in choices] == ["a", 'say "token_ids":[']
    assert strip_ids(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_ids_are_read_only_when_settled_up_to_the_last_event_with_text() -> None:
    progress = _progress()
    sent = [_event("a", [5], prompt=[1, 2]), _event("b", [6]), _event("", [7])]
    for block in sent:
        assert b"[5]" not in progress.take(block)
    assert progress.ids == [] and progress.prompt_ids is None
    progress.settle()
    assert progress.prompt_ids == [1, 2]
    assert progress.ids == [5, 6, 7] and progress.generated == [5, 6]
    assert not progress.finished and progress.pending == []
    assert progress.first_event == sent[0]


def test_a_finished_answer_commits_every_id_and_ids_asked_for_are_kept() -> None:
    progress = _progress(strip=False)
    block = _event("a", [5], prompt=[1]) + _event("", [6], last=True)
    assert progress.take(block) is block
    progress.settle()
    assert progress.finished and progress.generated == [5, 6]


def test_past_its_bounds_the_answer_keeps_nothing() -> None:
    by_bytes = _progress(max_bytes=100)
    by_tokens = _progress(max_tracked=1)
    for progress in (by_bytes, by_tokens):
        for block in (_event("a", [5], prompt=[1]), _event("b", [6])):
            progress.take(block)
        progress.settle()
        assert progress.overflow and progress.ids == [] and progress.pending == []
