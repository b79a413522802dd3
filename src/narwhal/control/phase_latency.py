"""Per-phase latencies of recently finished requests, for the role controller.

A request's time to first token has two parts, and each belongs to one phase: up to the
descriptor (the router's seat queue and the prefill leg: waiting for and running the
prompt on a producer) is prefill's; from the descriptor to the consumer's first token (the
KV pull, and waiting for a place in a consumer's batch when its batch is full) is
decode's. Time
per output token after the first is decode's too. Splitting TTFT this way keeps a full
decode batch from reading as prefill pressure.

Fed twice per request: at its first token (the TTFT parts, as soon as they are known, so
that a long answer does not delay the evidence by its length) and at its end (time per
output token). Memory is bounded by a fixed number of samples; `window` looks back over a
sliding span of those times, and can leave out requests that arrived before some moment (a
move: they were placed on the old split).

Work not done yet is evidence too. Told of each request as it arrives, it keeps those
without a first token; `window`, given an objective, counts each one still waiting past it
with its age so far (in the phase it waits in: before the descriptor, prefill's; after it,
the first-token wait), and each that ended without a first token after waiting that long:
an expired handoff, a prefill timeout, a queue timeout, a deadline, a client that gave up.
Under deep overload no request reaches its first token, and these are the evidence.

Each sample keeps its request's pool (base model): `window` may look at one pool's alone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from narwhal.protocol.errors import Cause
from narwhal.router.call import CLIENT_CLOSED, Stage
from narwhal.runtime.ranks import nearest_rank

if TYPE_CHECKING:
    from narwhal.router.call import Call

MAX_SAMPLES = 4096
PREFILL, DECODE = "prefill", "decode"
# Stages of a request waiting on prefill work (the router's seat queue, the prefill leg),
# and after its descriptor, on its consumer's first token.
_PREFILL_STAGES = frozenset({Stage.QUEUED, Stage.PREFILL})
_DECODE_STAGES = frozenset({Stage.HANDOFF, Stage.DECODE})
# Causes that say the request waited too long for prefill work, whatever its stage.
_PREFILL_CAUSES = frozenset({Cause.HANDOFF_EXPIRED.value, Cause.PREFILL_TIMEOUT.value})
# Causes that end a wait wherever it was (a deadline, a queue timeout or full queue, a
# first token that never came).
_WAIT_CAUSES = frozenset(
    {Cause.DEADLINE.value, Cause.UNAVAILABLE.value, Cause.FIRST_TOKEN_TIMEOUT.value}
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One successful request, times on `time.perf_counter()`."""

    arrival: float
    finished: float
    # Arrival to the prefill leg's end (the descriptor and the producer's first token);
    # the whole TTFT when no prefill leg ran (the consumer computed the prompt itself,
    # which is prefill work).
    prefill_s: float
    # Descriptor to the consumer's first token; None without a prefill leg.
    first_token_wait_s: float | None
    # Time per output token after the first; None with a single output token.
    tpot_s: float | None
    # Its pool (base model); None when it was not known.
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Percentile:
    """A p90 over the window and the samples it was taken from (None: no sample); of
    those, `pending` are requests without a first token, counted with their ages."""

    p90_s: float | None
    samples: int
    pending: int = 0


@dataclass(frozen=True, slots=True)
class WindowLatency:
    prefill: Percentile
    first_token_wait: Percentile
    tpot: Percentile


def sample_of(call: Call, now: float, *, finished: bool = True) -> Sample | None:
    """The request's sample at `now`, or None when it has no first token (or, once
    `finished`, did not succeed)."""
    if call.ttft_s is None or (finished and call.status != 200):
        return None
    # The router's `ttft_s` is the producer's first token (the prefill leg's end), or the
    # consumer's first byte when it served the request alone.
    first = call.ttft_s if call.first_byte_s is None else max(call.ttft_s, call.first_byte_s)
    alone = call.handoff == "fallback" or call.first_byte_s is None
    tokens = call.output_tokens or 0
    tpot = (now - call.arrival - first) / (tokens - 1) if tokens > 1 else None
    return Sample(
        arrival=call.arrival,
        finished=now,
        prefill_s=call.ttft_s,
        first_token_wait_s=None if alone else first - call.ttft_s,
        tpot_s=None if tpot is None else max(0.0, tpot),
        model=call.model,
    )


def waiting_of(call: Call, now: float) -> tuple[str, float] | None:
    """The phase a request without a first token waits on at `now`, and for how long
    (None: it waits on neither, reading its body or relaying)."""
    if call.stage in _PREFILL_STAGES or (call.stage in _DECODE_STAGES and call.ttft_s is None):
        # Without a descriptor, a consumer computing the prompt itself does prefill work.
        return PREFILL, now - call.arrival
    if call.stage in _DECODE_STAGES and call.ttft_s is not None:
        return DECODE, now - call.arrival - call.ttft_s
    return None


def stalled_of(call: Call, now: float) -> tuple[str, float] | None:
    """A request that ended at `now` without a first token: the phase it waited too long
    on and how long, when its end says it waited (None: it failed for another reason)."""
    if call.status == 200:
        return None
    if call.cause in _PREFILL_CAUSES:
        return PREFILL, now - call.arrival
    if call.cause in _WAIT_CAUSES or call.status == CLIENT_CLOSED:
        return waiting_of(call, now)
    return None


class PhaseLatency:
    """The latest requests' first-token parts and times per output token, and the
    requests still waiting for a first token."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        # (arrival, first token at, prefill_s, first_token_wait_s, model)
        self._firsts: deque[tuple[float, float, float, float | None, str | None]] = deque(
            maxlen=max_samples
        )
        # (arrival, finished, tpot_s, model)
        self._tpots: deque[tuple[float, float, float, str | None]] = deque(maxlen=max_samples)
        # Requests told of at their arrival that have no first token yet, by request id.
        self._open: dict[str, Call] = {}
        # (arrival, ended, phase, waited_s, model) of requests that ended without a first
        # token.
        self._stalled: deque[tuple[float, float, str, float, str | None]] = deque(
            maxlen=max_samples
        )

    def arrived(self, call: Call) -> None:
        """A request arrived: until its first token (or its end) it is work waiting."""
        self._open[call.request_id] = call

    def first_token(self, call: Call, now: float) -> None:
        """The request's first token is on its way to the client (`now` on
        `time.perf_counter()`, as `call.arrival` is)."""
        self._open.pop(call.request_id, None)
        sample = sample_of(call, now, finished=False)
        if sample is not None:
            self._firsts.append(
                (sample.arrival, now, sample.prefill_s, sample.first_token_wait_s, call.model)
            )

    def add(self, call: Call, now: float) -> None:
        """The request ended at `now`: its time per output token, if it succeeded; how
        long it waited, if it ended without a first token while waiting."""
        if self._open.pop(call.request_id, None) is not None:
            stalled = stalled_of(call, now)
            if stalled is not None:
                self._stalled.append((call.arrival, now, *stalled, call.model))
        sample = sample_of(call, now)
        if sample is not None and sample.tpot_s is not None:
            self._tpots.append((sample.arrival, now, sample.tpot_s, call.model))

    @property
    def open(self) -> int:
        """Requests without a first token (nor an end) yet."""
        return len(self._open)

    def record(self, sample: Sample) -> None:
        """A finished request given directly (tests, other feeds): its first token came
        `prefill_s` and `first_token_wait_s` after its arrival."""
        first_at = sample.arrival + sample.prefill_s + (sample.first_token_wait_s or 0.0)
        self._firsts.append(
            (sample.arrival, first_at, sample.prefill_s, sample.first_token_wait_s, sample.model)
        )
        if sample.tpot_s is not None:
            self._tpots.append((sample.arrival, sample.finished, sample.tpot_s, sample.model))

    def window(
        self,
        now: float,
        window_s: float,
        arrived_since: float | None = None,
        overdue_s: float | None = None,
        model: str | None = None,
    ) -> WindowLatency:
        """p90s over first tokens and ends in the last `window_s`, of requests that arrived
        at or after `arrived_since` (when given). With `overdue_s`, the TTFT parts also
        count requests waiting longer than that now, with their ages, and those that ended
        in the window without a first token after waiting that long. With `model`, only
        that pool's requests count (a request whose model is not known yet, none)."""
        since = now - window_s
        after = -math.inf if arrived_since is None else arrived_since
        if model is None:
            firsts = [f for f in self._firsts if f[1] >= since and f[0] >= after]
            tpots = [t[2] for t in self._tpots if t[1] >= since and t[0] >= after]
        else:
            firsts = [f for f in self._firsts if f[1] >= since and f[0] >= after and f[4] == model]
            tpots = [t[2] for t in self._tpots if t[1] >= since and t[0] >= after and t[3] == model]
        waits: dict[str, list[float]] = {PREFILL: [], DECODE: []}
        if overdue_s is not None:
            for call in self._open.values():
                if model is not None and call.model != model:
                    continue
                waiting = waiting_of(call, now) if call.arrival >= after else None
                if waiting is not None and waiting[1] >= overdue_s:
                    waits[waiting[0]].append(waiting[1])
            for arrival, ended, phase, waited, of in self._stalled:
                if model is not None and of != model:
                    continue
                if ended >= since and arrival >= after and waited >= overdue_s:
                    waits[phase].append(waited)
        return WindowLatency(
            _p90([f[2] for f in firsts], waits[PREFILL]),
            _p90([f[3] for f in firsts if f[3] is not None], waits[DECODE]),
            _p90(tpots),
        )


def _p90(values: list[float], pending: list[float] | None = None) -> Percentile:
    values = values + (pending or [])
    values.sort()
    return Percentile(nearest_rank(values, 90) if values else None, len(values), len(pending or ()))
