"""What the role controller measures per phase: TTFT split at the descriptor, time per
output token after the consumer's first, and a window that can leave out older arrivals."""

from __future__ import annotations

from narwhal.control.phase_latency import PhaseLatency, Sample, sample_of
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call


def call(**fields: object) -> Call:
    done = Call("r1", None, Endpoint.COMPLETIONS, arrival=10.0, deadline=99.0)
    done.status = 200
    for key, value in fields.items():
        setattr(done, key, value)
    return done


def test_the_wait_after_the_descriptor_is_decode_s_and_the_prefill_leg_is_prefill_s() -> None:
    # Producer's first token at 0.2 s, consumer's at 1.5 s, 11 tokens by 2.5 s.
    sample = sample_of(call(ttft_s=0.2, first_byte_s=1.5, output_tokens=11), 12.5)
    assert sample is not None
    assert sample.prefill_s == 0.2
    assert sample.first_token_wait_s is not None and abs(sample.first_token_wait_s - 1.3) < 1e-9
    assert sample.tpot_s is not None and abs(sample.tpot_s - 0.1) < 1e-9


def test_a_request_served_by_fallback_is_all_prefill() -> None:
    sample = sample_of(
        call(ttft_s=0.9, first_byte_s=0.9, output_tokens=1, handoff="fallback"), 11.0
    )
    assert sample is not None
    assert (sample.prefill_s, sample.first_token_wait_s, sample.tpot_s) == (0.9, None, None)


def test_a_failed_request_gives_no_sample() -> None:
    assert sample_of(call(status=502, ttft_s=0.1, first_byte_s=0.2), 11.0) is None
    assert sample_of(call(ttft_s=None), 11.0) is None


def test_the_window_keeps_recent_finishes_and_can_drop_earlier_arrivals() -> None:
    latency = PhaseLatency()
    for i in range(10):  # arrivals 0..9, finishing one second later, prefill 0.1 .. 1.0
        latency.record(Sample(float(i), i + 1.0, (i + 1) / 10, 0.01, 0.02))
    everything = latency.window(10.0, 100.0)
    assert everything.prefill.samples == 10 and everything.prefill.p90_s == 0.9
    assert latency.window(10.0, 3.5).prefill.samples == 4  # finished at 7..10
    newer = latency.window(10.0, 100.0, arrived_since=5.0)
    assert newer.prefill.samples == 5 and newer.prefill.p90_s == 1.0
    assert newer.first_token_wait.samples == 5 and newer.tpot.p90_s == 0.02
    empty = latency.window(10.0, 100.0, arrived_since=50.0)
    assert empty.prefill == empty.tpot and empty.prefill.p90_s is None


def test_the_ttft_parts_count_at_the_first_token_and_tpot_at_the_end() -> None:
    latency = PhaseLatency()
    running = call(status=0, ttft_s=0.2, first_byte_s=1.5, output_tokens=None)
    latency.first_token(running, 11.5)
    # A long answer is still streaming: its TTFT parts are evidence already.
    now = latency.window(11.6, 5.0)
    assert (now.prefill.p90_s, now.first_token_wait.samples, now.tpot.samples) == (0.2, 1, 0)
    running.status, running.output_tokens = 200, 11
    latency.add(running, 12.5)
    done = latency.window(12.6, 5.0)
    assert done.prefill.samples == 1 and done.tpot.samples == 1
    failed = call(status=502, ttft_s=0.3, first_byte_s=0.4, output_tokens=3)
    latency.add(failed, 12.6)
    assert latency.window(12.7, 5.0).tpot.samples == 1
