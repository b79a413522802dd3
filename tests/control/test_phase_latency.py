"""What the role controller measures per phase: TTFT split at the descriptor, time per
output token after the consumer's first, and a window that can leave out older arrivals."""

from __future__ import annotations

from narwhal.control.phase_latency import PhaseLatency, Sample, sample_of
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call, Stage


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


def waiting(request_id: str, arrival: float, stage: Stage, ttft_s: float | None = None) -> Call:
    pending = Call(request_id, None, Endpoint.COMPLETIONS, arrival=arrival, deadline=99.0)
    pending.stage, pending.ttft_s = stage, ttft_s
    return pending


def test_requests_still_waiting_past_the_objective_count_with_their_ages() -> None:
    latency = PhaseLatency()
    latency.arrived(waiting("old", 0.0, Stage.PREFILL))  # 10 s in the producer's queue
    latency.arrived(waiting("queued", 4.0, Stage.QUEUED))  # 6 s waiting for a seat
    latency.arrived(waiting("young", 9.5, Stage.PREFILL))  # within the objective
    latency.arrived(waiting("reading", 0.0, Stage.ADMISSION))  # the client's upload
    # Past its descriptor 3 s ago (its producer answered at 1 s): the first-token wait.
    latency.arrived(waiting("pulling", 6.0, Stage.DECODE, ttft_s=1.0))
    assert latency.open == 5
    # Without an objective, nothing pending counts (as before).
    plain = latency.window(10.0, 30.0)
    assert plain.prefill.samples == 0 and plain.first_token_wait.samples == 0
    now = latency.window(10.0, 30.0, overdue_s=1.0)
    assert (now.prefill.samples, now.prefill.pending, now.prefill.p90_s) == (2, 2, 10.0)
    assert (now.first_token_wait.pending, now.first_token_wait.p90_s) == (1, 3.0)
    assert now.tpot.samples == 0
    # As they age, the evidence grows; placed before a move, they are left out.
    assert latency.window(20.0, 30.0, overdue_s=1.0).prefill.p90_s == 20.0
    assert latency.window(10.0, 30.0, arrived_since=2.0, overdue_s=1.0).prefill.samples == 1


def test_a_first_token_or_a_success_ends_the_wait() -> None:
    latency = PhaseLatency()
    served = waiting("r1", 0.0, Stage.DECODE, ttft_s=4.0)
    latency.arrived(served)
    served.first_byte_s = 5.0
    latency.first_token(served, 5.0)
    window = latency.window(10.0, 30.0, overdue_s=1.0)
    assert window.prefill.pending == 0 and window.prefill.p90_s == 4.0
    assert latency.open == 0
    latency.arrived(quick := waiting("r2", 8.0, Stage.PREFILL))
    quick.status = 200
    latency.add(quick, 9.0)
    assert latency.open == 0 and latency.window(10.0, 30.0, overdue_s=0.1).prefill.pending == 0


def test_requests_that_gave_up_waiting_count_in_the_phase_they_waited_on() -> None:
    latency = PhaseLatency()
    expired = waiting("expired", 0.0, Stage.HANDOFF, ttft_s=26.0)
    expired.status, expired.cause = 504, "handoff_expired"
    timed_out = waiting("queue", 0.0, Stage.QUEUED)
    timed_out.status, timed_out.cause = 503, "unavailable"
    left = waiting("left", 10.0, Stage.DECODE, ttft_s=2.0)
    left.status = 499
    broken = waiting("broken", 0.0, Stage.PREFILL)
    broken.status, broken.cause = 502, "connect"
    for ended in (expired, timed_out, left, broken):
        latency.arrived(ended)
        latency.add(ended, 30.0)
    window = latency.window(31.0, 30.0, overdue_s=1.0)
    # The expired handoff waited on prefill (its descriptor aged in the producer's queue),
    # as did the queue timeout; the client gave up 18 s after its descriptor.
    assert (window.prefill.pending, window.prefill.p90_s) == (2, 30.0)
    assert (window.first_token_wait.pending, window.first_token_wait.p90_s) == (1, 18.0)
    assert latency.open == 0
    # They leave the window as finished requests do.
    assert latency.window(70.0, 30.0, overdue_s=1.0).prefill.samples == 0


def test_a_window_of_one_pool_counts_that_models_requests_alone() -> None:
    latency = PhaseLatency()
    latency.record(Sample(0.0, 5.0, 1.0, 0.2, 0.01, "a"))
    latency.record(Sample(0.0, 5.0, 3.0, 0.4, 0.03, "b"))
    waiting = call(arrival=0.0, stage=Stage.PREFILL)
    waiting.model = "b"
    latency.arrived(waiting)
    unknown = call(request_id="r2", arrival=0.0, stage=Stage.PREFILL)
    latency.arrived(unknown)  # its model not resolved yet: in no pool's window
    a = latency.window(6.0, 10.0, overdue_s=2.0, model="a")
    b = latency.window(6.0, 10.0, overdue_s=2.0, model="b")
    whole = latency.window(6.0, 10.0, overdue_s=2.0)
    assert (a.prefill.p90_s, a.prefill.samples, a.prefill.pending) == (1.0, 1, 0)
    assert (a.tpot.p90_s, a.first_token_wait.p90_s) == (0.01, 0.2)
    assert (b.prefill.p90_s, b.prefill.samples, b.prefill.pending) == (6.0, 2, 1)
    assert (b.tpot.p90_s, b.first_token_wait.p90_s) == (0.03, 0.4)
    assert (whole.prefill.samples, whole.prefill.pending, whole.tpot.samples) == (4, 2, 2)
