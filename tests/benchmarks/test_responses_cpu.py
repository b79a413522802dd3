"""The Responses CPU benchmark: its shapes' bodies, how it checks an answer, its flags, and a
short run that yields every figure with no request failed."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from responses_cpu import (
    BASELINE,
    NOW,
    NOW_AGAIN,
    SHAPES,
    Plan,
    Report,
    Tally,
    against_baseline,
    against_chat,
    answered_tokens,
    chosen_shapes,
    format_report,
    measure,
    parser,
    plan_from_args,
    report_json,
)

SOURCE = Path(__file__).resolve().parents[2] / "src"


def test_every_shape_asks_the_same_output_of_its_route() -> None:
    for each in SHAPES:
        body = orjson.loads(each.body(64))
        assert body["stream"] is each.stream
        if each.responses:
            assert body["max_output_tokens"] == 64 and isinstance(body["input"], str)
            assert body.get("store", True) is each.store
        else:
            assert body["max_tokens"] == 64 and "store" not in body


def test_answers_are_counted_and_a_cut_stream_is_refused() -> None:
    chat_stream, chat_whole, responses_stream, responses_whole = chosen_shapes(
        "responses-stream,chat-stream,chat-whole,responses-whole"
    )
    completed = {"type": "response.completed", "response": {"usage": {"output_tokens": 2}}}
    streamed = (
        b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n'
        b"event: response.completed\ndata: " + orjson.dumps(completed) + b"\n\n"
    )
    assert answered_tokens(responses_stream, streamed) == 2
    with pytest.raises(ValueError, match="ended with"):
        answered_tokens(responses_stream, streamed.rsplit(b"event: ", 1)[0])
    chunk = b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    last = b'data: {"choices":[{"delta":{"content":"b"},"finish_reason":"length"}]}\n\n'
    empty = b'data: {"choices":[{"delta":{"content":""},"finish_reason":null}]}\n\n'
    assert answered_tokens(chat_stream, empty + chunk * 3 + last + b"data: [DONE]\n\n") == 4
    with pytest.raises(ValueError, match=r"\[DONE\]"):
        answered_tokens(chat_stream, chunk * 3)
    assert answered_tokens(chat_whole, b'{"usage":{"completion_tokens":5}}') == 5
    assert answered_tokens(responses_whole, b'{"usage":{"output_tokens":4}}') == 4
    with pytest.raises(ValueError, match="no output token count"):
        answered_tokens(responses_whole, b'{"error":{}}')


def test_the_flags_make_the_plan() -> None:
    args = parser().parse_args(
        ["--requests", "10", "--shapes", "responses-whole, chat-whole", "--baseline", "old/src"]
    )
    plan = plan_from_args(args)
    assert plan.requests == 10 and plan.baseline == Path("old/src").resolve()
    assert [s.name for s in plan.shapes] == ["chat-whole", "responses-whole"]
    assert chosen_shapes(None) == SHAPES
    with pytest.raises(ValueError, match="shapes are"):
        chosen_shapes("chat-stream,everything")


async def test_a_short_run_gives_every_figure(tmp_path: Path) -> None:
    picked = chosen_shapes("chat-stream,chat-whole,responses-stream,responses-whole")
    # This tree's own source as the baseline: the comparison runs, its figures are noise.
    plan = Plan(requests=24, trials=1, concurrency=4, max_tokens=8, shapes=picked, baseline=SOURCE)
    report = await measure(plan, tmp_path, say=lambda text: None)
    table = format_report(report)
    assert report.errors == 0, table
    assert set(report.tallies) == {NOW, NOW_AGAIN, BASELINE}
    assert set(report.tallies[NOW]) == {s.name for s in picked}
    assert set(report.tallies[BASELINE]) == {"chat-stream", "chat-whole"}
    assert all(t.ok == 24 for shapes in report.tallies.values() for t in shapes.values())
    # CPU is read in clock ticks: a 24-request batch may measure 0 s, so its ratio may be
    # n/a. The ratios' arithmetic is checked on fixed tallies below.
    chat = against_chat(report)
    assert set(chat) == {"responses-stream", "responses-whole"}
    assert all(f["responses"] is not None and f["chat"] is not None for f in chat.values())
    before = against_baseline(report)
    assert set(before) == {"chat-stream", "chat-whole"}
    assert all(f["now"] is not None and f["baseline"] is not None for f in before.values())
    assert "Responses over chat" in table and "Now over baseline" in table
    assert orjson.loads(report_json(report))["against_chat"].keys() == chat.keys()


def test_the_ratios_are_cpu_per_request_over_cpu_per_request() -> None:
    def tally(ok: int, cpu_s: float) -> Tally:
        return Tally(ok=ok, router_cpu_s=cpu_s)

    report = Report(
        Plan(),
        {
            NOW: {
                "chat-stream": tally(100, 0.5),
                "responses-stream": tally(50, 0.5),
                "chat-whole": tally(10, 0.1),
            },
            NOW_AGAIN: {"chat-stream": tally(100, 0.7)},
            BASELINE: {"chat-stream": tally(200, 0.8), "chat-whole": tally(10, 0.0)},
        },
    )
    chat = against_chat(report)
    assert chat == {"responses-stream": {"responses": 10.0, "chat": 5.0, "ratio": 2.0}}
    before = against_baseline(report)
    assert before["chat-stream"] == pytest.approx(
        {"now": 6.0, "baseline": 4.0, "ratio": 1.5, "noise": 1.4}
    )
    # A batch that measured no CPU has no ratio against it, rather than a division by zero.
    assert before["chat-whole"] == {"now": 10.0, "baseline": 0.0, "ratio": None, "noise": None}
