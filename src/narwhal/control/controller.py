"""The role controller's decision: which engine of role `both`, if any, should change the
phase it serves. Pure: an observation and the controller's memory in, at most one move out,
with the reason and the inputs it was taken on. `control_loop` gathers the observation and
applies the move through `operations`.

**Pressure.** Each phase's pressure is its p90 latency over its objective, a pressure of
1 meaning the phase sits at its SLO. Prefill's is the time to the producer's first token
(the router's seat queue and the prefill leg) over `[slo] ttft_s`. Decode's is the larger
of the time per output token after the first over `[slo] tpot_s` and the wait from the
descriptor to the consumer's first token (the KV pull, and a place in a full batch) over
`[slo] ttft_s`: a consumer whose batch is full makes new requests wait for their first
token, and that wait is decode's, not prefill's. Only requests that arrived after the last
move count: they were placed on the split as it is now, so no move is taken twice on the
same evidence, and a move that was not enough shows as such.

**When an engine moves** (checked in this order; the first that fails is the reason to hold):

| rule              | holds when                                                       |
|-------------------|------------------------------------------------------------------|
| samples           | either phase has fewer than `min_samples` requests in the window |
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

    def explain(self) -> str:
        shown = ", ".join(f"{key} {_fmt(value)}" for key, value in self.inputs.items())
        return f"{self.reason}: {self.detail}" + (f" ({shown})" if shown else "")


def serving(engines: tuple[EngineView, ...], phase: Role) -> int:
    """Engines in service that serve `phase` (prefill or decode)."""
    return sum(e.in_service and e.role.can_do(phase.value) for e in engines)


def decide(
    obs: Observation, state: ControlState, config: ControllerConfig, slo: SloConfig
) -> Decision:
    """At most one move, and why; see the module's table for the order of the rules."""
    n_prefill = serving(obs.engines, Role.PREFILL)
    n_decode = serving(obs.engines, Role.DECODE)
    inputs: Inputs = {
        "ttft_p90_s": obs.prefill.p90_s,
        "tpot_p90_s": obs.decode.p90_s,
        "first_token_wait_p90_s": obs.decode.wait_p90_s,
        "prefill_samples": obs.prefill.samples,
        "decode_samples": obs.decode.samples,
        "queued": obs.prefill.queued,
        "prefill_waiting": obs.prefill.waiting,
        "decode_waiting": obs.decode.waiting,
        "decode_seats": obs.decode.seats_in_use,
        "prefill_engines": n_prefill,
        "decode_engines": n_decode,
    }

    def hold(reason: str, detail: str) -> Decision:
        return Decision(None, reason, detail, inputs)

    p_load, d_load = obs.prefill, obs.decode
    if (
        p_load.p90_s is None
        or d_load.p90_s is None
        or min(p_load.samples, d_load.samples) < config.min_samples
    ):
        return hold("samples", f"fewer than {config.min_samples} requests in a phase's window")
    pp = p_load.p90_s / slo.ttft_s
    pd = max(d_load.p90_s / slo.tpot_s, (d_load.wait_p90_s or 0.0) / slo.ttft_s)
    inputs["prefill_pressure"], inputs["decode_pressure"] = round(pp, 3), round(pd, 3)
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
    if n_donor - 1 < floor:
        return hold("floor", f"{donor.value} would drop below {floor} engines")
    donor_after = low * n_donor / (n_donor - 1)
    high_after = high * n_high / (n_high + 1) if n_high else 0.0
    inputs["donor_projected"] = round(donor_after, 3)
    if donor_after > 1.0:
        return hold("donor_slo", f"{donor.value} one engine short projected at {donor_after:.2f}")
    if donor_after > high_after * config.ratio:
        return hold("overshoot", f"{donor.value} would become the pressured phase")
    candidates = [
        e for e in obs.engines if e.capable and not e.pinned and e.in_service and e.role is donor
    ]
    settled = [e for e in candidates if obs.now - e.since >= config.dwell_s]
    if not settled:
        why = "within their dwell time" if candidates else "no unpinned role both engine"
        return hold("candidates", f"{donor.value} engines to move: {why}")
    chosen = min(settled, key=lambda e: (e.busy, e.id))
    reason = TOWARD_PREFILL if to_prefill else TOWARD_DECODE
    detail = f"{target.value} pressure {high:.2f} vs {donor.value} {low:.2f}"
    return Decision(Move(chosen.id, donor, target), reason, detail, inputs)


def after(decision: Decision, state: ControlState, now: float) -> ControlState:
    """The memory after a decision that was applied."""
    if decision.move is None:
        return state
    return ControlState(last_move_at=now)


def _fmt(value: float | int | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
