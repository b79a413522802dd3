"""The role controller's decision: which engines of role `both`, if any, should change the
phase they serve. Pure: an observation and the controller's memory in, the moves out (none,
one, or under overload a few), with the reason and the inputs they were taken on.
`control_loop` gathers the observation and applies the moves through `operations`.

**Pressure.** Each phase's pressure is its p90 latency over its objective, a pressure of
1 meaning the phase sits at its SLO. Prefill's is the time to the producer's first token
(the router's seat queue and the prefill leg) over `[slo] ttft_s`. Decode's is the larger
of the time per output token after the first over `[slo] tpot_s` and the wait from the
descriptor to the consumer's first token (the KV pull, and a place in a full batch) over
`[slo] ttft_s`: a consumer whose batch is full makes new requests wait for their first
token, and that wait is decode's, not prefill's. Only requests that arrived after the last
move count: they were placed on the split as it is now, so no move is taken twice on the
same evidence, and a move that was not enough shows as such.

**Evidence from work not done yet.** A request still waiting for its first token past the
TTFT objective counts in its phase's p90 with its age so far, and so does one that ended
without a first token while waiting (an expired handoff, a prefill or queue timeout, a
deadline, a client that gave up): `pending` counts them. The engines' own mean queue time
(`vllm:request_queue_time_seconds`, since the last decision) is a floor under each phase's
pressure. So the deeper the overload, the more evidence, not the less.

**A phase that sees nothing.** When one phase is overloaded (at least `min_samples`
pending requests) and the other has too few samples because nothing reaches it, and
nothing waits for it either (no pending requests, queues or queue time), the other phase
is idle: its pressure is taken as 0 (`idle` in the inputs), and at most one engine moves.

**When an engine moves** (checked in this order; the first that fails is the reason to hold):

| rule              | holds when                                                       |
|-------------------|------------------------------------------------------------------|
| samples           | either phase has fewer than `min_samples` requests in the window |
|                   |   (and is not idle beside an overloaded phase)                   |
| cooldown          | a move happened less than `cooldown_s` ago                       |
| objectives        | the higher pressure is below `min_pressure`                      |
| band (hysteresis) | the higher pressure is less than `ratio` times the lower         |
| floor             | the other phase would drop below `min_prefill` / `min_decode`    |
| donor SLO         | the other phase, one engine fewer, is projected over its SLO     |
| overshoot         | after the move the other phase would be the pressured one        |
| candidates        | no engine of role `both`, unpinned, in service and past `dwell_s` |
|                   |   serves only the other phase                                    |

Projection assumes a phase's pressure scales with the inverse of its engine count. The
engine moved is the candidate with the fewest seats in use (the fewest requests to finish
on it in its old role).

**Several engines at once.** When the pressured phase is overloaded (at least
`min_samples` pending requests) and its backlog is several engines' worth (by the same
projection, it would still be over its objective with one engine more), one decision may
move up to `max_moves` engines: the k-th only while the phase, k-1 engines more, is still
projected over its objective, and while the other phase, k engines fewer, keeps its floor,
stays projected within its SLO and does not become the pressured one (the same rules as
for one move, so a move never strands the other phase), and only settled candidates.
Never when the other phase's pressure is only taken as idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import Role

# Reasons a move is made (the metric's label values) and reasons to hold.
TOWARD_PREFILL = "ttft_pressure"
TOWARD_DECODE = "tpot_pressure"
MOVE_REASONS = (TOWARD_PREFILL, TOWARD_DECODE)

Inputs = dict[str, float | int | str | None]


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as the controller sees it."""

    id: str
    # The role it acts in now (prefill, decode, or both for an engine not split).
    role: Role
    # Its spec role is `both`: it can act in either phase.
    capable: bool
    pinned: bool = False
    # Admitted (or briefly quarantined): counts toward its phase.
    in_service: bool = True
    # When it took its current role (event-loop seconds).
    since: float = 0.0
    # Seats of its current phase held by requests.
    busy: int = 0


@dataclass(frozen=True, slots=True)
class PhaseLoad:
    """One phase over the window: its p90 latency and what is waiting for it."""

    p90_s: float | None
    samples: int
    # Decode only: the p90 wait from the descriptor to the consumer's first token.
    wait_p90_s: float | None = None
    # Requests waiting for a seat in the router, and the engines' own reported queues.
    queued: int = 0
    waiting: float = 0.0
    seats_in_use: int = 0
    # Of the samples (decode: of the first-token waits), requests still waiting past the
    # TTFT objective or that ended without a first token while waiting (their ages).
    pending: int = 0
    # The engines' mean queue time since the last decision (None: none reported).
    queue_time_s: float | None = None

    def backlogged(self) -> bool:
        """Whether anything waits for this phase: pending requests, queues, queue time."""
        return bool(self.pending or self.queued or self.waiting or self.queue_time_s)


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    engines: tuple[EngineView, ...]
    prefill: PhaseLoad
    decode: PhaseLoad


@dataclass(frozen=True, slots=True)
class ControlState:
    """What the controller remembers between decisions."""

    last_move_at: float | None = None


@dataclass(frozen=True, slots=True)
class Move:
    engine: str
    old: Role
    new: Role


@dataclass(frozen=True, slots=True)
class Decision:
    move: Move | None
    reason: str
    detail: str
    inputs: Inputs = field(default_factory=dict)
    # Under overload, the engines moved beside `move` in the same decision.
    more: tuple[Move, ...] = ()

    @property
    def moves(self) -> tuple[Move, ...]:
        """Every engine this decision moves, `move` first."""
        return () if self.move is None else (self.move, *self.more)

    def explain(self) -> str:
        shown = ", ".join(f"{key} {_fmt(value)}" for key, value in self.inputs.items())
        return f"{self.reason}: {self.detail}" + (f" ({shown})" if shown else "")


def serving(engines: tuple[EngineView, ...], phase: Role) -> int:
    """Engines in service that serve `phase` (prefill or decode)."""
    return sum(e.in_service and e.role.can_do(phase.value) for e in engines)


def decide(
    obs: Observation, state: ControlState, config: ControllerConfig, slo: SloConfig
) -> Decision:
    """The moves, if any, and why; see the module's table for the order of the rules."""
    n_prefill = serving(obs.engines, Role.PREFILL)
    n_decode = serving(obs.engines, Role.DECODE)
    p_load, d_load = obs.prefill, obs.decode
    inputs: Inputs = {
        "ttft_p90_s": p_load.p90_s,
        "tpot_p90_s": d_load.p90_s,
        "first_token_wait_p90_s": d_load.wait_p90_s,
        "prefill_samples": p_load.samples,
        "decode_samples": d_load.samples,
        "queued": p_load.queued,
        "prefill_waiting": p_load.waiting,
        "decode_waiting": d_load.waiting,
        "decode_seats": d_load.seats_in_use,
        "prefill_engines": n_prefill,
        "decode_engines": n_decode,
    }
    if p_load.pending or d_load.pending:
        inputs["prefill_pending"], inputs["decode_pending"] = p_load.pending, d_load.pending
    for key, queue_time in (("prefill", p_load.queue_time_s), ("decode", d_load.queue_time_s)):
        if queue_time is not None:
            inputs[f"{key}_queue_time_s"] = queue_time

    def hold(reason: str, detail: str) -> Decision:
        return Decision(None, reason, detail, inputs)

    pressures = _pressures(p_load, d_load, config, slo)
    if pressures is None:
        return hold("samples", f"fewer than {config.min_samples} requests in a phase's window")
    pp, pd, idle = pressures
    inputs["prefill_pressure"], inputs["decode_pressure"] = round(pp, 3), round(pd, 3)
    if idle is not None:
        inputs["idle"] = idle.value
    if state.last_move_at is not None and obs.now - state.last_move_at < config.cooldown_s:
        return hold("cooldown", f"last move {obs.now - state.last_move_at:.1f} s ago")
    to_prefill = pp >= pd
    high, low = (pp, pd) if to_prefill else (pd, pp)
    target, donor = (Role.PREFILL, Role.DECODE) if to_prefill else (Role.DECODE, Role.PREFILL)
    n_high, n_donor = (n_prefill, n_decode) if to_prefill else (n_decode, n_prefill)
    if high < config.min_pressure:
        return hold("objectives", f"both phases below {config.min_pressure:g} of their SLO")
    if high < config.ratio * low:
        return hold("band", f"{target.value} pressure under {config.ratio:g}x {donor.value}'s")
    floor = config.min_decode if donor is Role.DECODE else config.min_prefill

    def refusal(k: int) -> tuple[str, str] | None:
        """Why the other phase cannot give `k` engines (None: it can)."""
        if n_donor - k < floor:
            return "floor", f"{donor.value} would drop below {floor} engines"
        donor_after = low * n_donor / (n_donor - k)
        high_after = high * n_high / (n_high + k) if n_high else 0.0
        if k == 1:
            inputs["donor_projected"] = round(donor_after, 3)
        if donor_after > 1.0:
            return "donor_slo", f"{donor.value} one engine short projected at {donor_after:.2f}"
        if donor_after > high_after * config.ratio:
            return "overshoot", f"{donor.value} would become the pressured phase"
        return None

    refused = refusal(1)
    if refused is not None:
        return hold(*refused)
    candidates = [
        e for e in obs.engines if e.capable and not e.pinned and e.in_service and e.role is donor
    ]
    settled = sorted(
        (e for e in candidates if obs.now - e.since >= config.dwell_s),
        key=lambda e: (e.busy, e.id),
    )
    if not settled:
        why = "within their dwell time" if candidates else "no unpinned role both engine"
        return hold("candidates", f"{donor.value} engines to move: {why}")
    count = 1
    overloaded = (p_load if to_prefill else d_load).pending >= config.min_samples
    if overloaded and idle is None:
        # Several engines' worth of backlog: with `count` engines more the phase is still
        # projected over its objective, and the other phase can give one more.
        while (
            count < min(config.max_moves, len(settled))
            and high * n_high / (n_high + count) > 1.0
            and refusal(count + 1) is None
        ):
            count += 1
    moves = [Move(e.id, donor, target) for e in settled[:count]]
    reason = TOWARD_PREFILL if to_prefill else TOWARD_DECODE
    detail = f"{target.value} pressure {high:.2f} vs {donor.value} {low:.2f}"
    if count > 1:
        inputs["engines_moved"] = count
        detail += f"; {count} engines' worth of backlog moves {count} engines"
    return Decision(moves[0], reason, detail, inputs, tuple(moves[1:]))


def _pressures(
    p_load: PhaseLoad, d_load: PhaseLoad, config: ControllerConfig, slo: SloConfig
) -> tuple[float, float, Role | None] | None:
    """Each phase's pressure, and the phase taken as idle (if one is); None when the
    evidence is too thin to decide on."""
    wanted = config.min_samples
    prefill_known = p_load.p90_s is not None and p_load.samples >= wanted
    decode_known = (
        d_load.p90_s is not None or d_load.wait_p90_s is not None
    ) and d_load.samples + d_load.pending >= wanted
    if d_load.p90_s is None and d_load.pending < wanted:
        decode_known = False  # as before the pending evidence: the time per token decides
    pp = max(p_load.p90_s or 0.0, p_load.queue_time_s or 0.0) / slo.ttft_s if prefill_known else 0.0
    pd = (
        max(
            (d_load.p90_s or 0.0) / slo.tpot_s,
            max(d_load.wait_p90_s or 0.0, d_load.queue_time_s or 0.0) / slo.ttft_s,
        )
        if decode_known
        else 0.0
    )
    if prefill_known and decode_known:
        return pp, pd, None
    # An overloaded phase beside one that sees nothing because nothing reaches it.
    if prefill_known and p_load.pending >= wanted and not d_load.backlogged():
        return pp, 0.0, Role.DECODE
    if decode_known and d_load.pending >= wanted and not p_load.backlogged():
        return 0.0, pd, Role.PREFILL
    return None


def after(decision: Decision, state: ControlState, now: float) -> ControlState:
    """The memory after a decision that was applied."""
    if decision.move is None:
        return state
    return ControlState(last_move_at=now)


def _fmt(value: float | int | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
