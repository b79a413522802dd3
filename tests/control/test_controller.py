"""The role controller's pure decision: floors, pins, dwell, cooldown, the band, direction."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import Role
from narwhal.control.controller import (
    TOWARD_DECODE,
    TOWARD_PREFILL,
    ControlState,
    Decision,
    EngineView,
    Observation,
    PhaseLoad,
    after,
    decide,
    serving,
)

SLO = SloConfig(ttft_s=1.0, tpot_s=0.05)
CONFIG = ControllerConfig(enabled=True, dwell_s=10.0, cooldown_s=5.0, min_samples=5)


def engines(prefill: int, decode: int, *, since: float = 0.0) -> tuple[EngineView, ...]:
    views = [EngineView(f"p{i}", Role.PREFILL, True, since=since) for i in range(prefill)]
    views += [EngineView(f"d{i}", Role.DECODE, True, since=since) for i in range(decode)]
    return tuple(views)


def obs(
    table: tuple[EngineView, ...], ttft: float, tpot: float, now: float = 100.0, samples: int = 50
) -> Observation:
    return Observation(now, table, PhaseLoad(ttft, samples), PhaseLoad(tpot, samples))


def apply(table: tuple[EngineView, ...], decision: Decision, now: float) -> tuple[EngineView, ...]:
    move = decision.move
    if move is None:
        return table
    return tuple(replace(e, role=move.new, since=now) if e.id == move.engine else e for e in table)


def test_prefill_pressure_moves_a_decode_engine_to_prefill() -> None:
    decision = decide(obs(engines(2, 2), ttft=3.0, tpot=0.01), ControlState(), CONFIG, SLO)
    assert decision.move is not None
    assert (decision.move.old, decision.move.new) == (Role.DECODE, Role.PREFILL)
    assert decision.reason == TOWARD_PREFILL
    assert decision.inputs["ttft_p90_s"] == 3.0
    assert "prefill pressure" in decision.explain()


def test_decode_pressure_moves_a_prefill_engine_to_decode() -> None:
    decision = decide(obs(engines(2, 2), ttft=0.1, tpot=0.1), ControlState(), CONFIG, SLO)
    assert decision.move is not None
    assert decision.move.new is Role.DECODE
    assert decision.reason == TOWARD_DECODE


def test_too_few_samples_holds() -> None:
    decision = decide(obs(engines(2, 2), 3.0, 0.01, samples=2), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "samples"


def test_inside_the_band_holds() -> None:
    # Prefill at 1.2x its SLO, decode at 1.0x: under the 1.5 ratio.
    decision = decide(obs(engines(2, 2), 1.2, 0.05), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason in ("band", "donor_slo")


def test_both_well_within_objectives_holds() -> None:
    decision = decide(obs(engines(2, 2), 0.5, 0.001), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "objectives"


def test_cooldown_holds_then_releases() -> None:
    state = ControlState(last_move_at=98.0)
    held = decide(obs(engines(2, 2), 3.0, 0.01), state, CONFIG, SLO)
    assert held.move is None and held.reason == "cooldown"
    later = decide(obs(engines(2, 2), 3.0, 0.01, now=104.0), state, CONFIG, SLO)
    assert later.move is not None


def test_dwell_holds_recently_moved_engines() -> None:
    table = engines(2, 2, since=95.0)
    decision = decide(obs(table, 3.0, 0.01), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "candidates"


def test_pinned_and_fixed_role_engines_are_never_candidates() -> None:
    table = (
        EngineView("p0", Role.PREFILL, True),
        EngineView("d0", Role.DECODE, True, pinned=True),
        EngineView("d1", Role.DECODE, False),
        EngineView("d2", Role.DECODE, True, pinned=True),
    )
    decision = decide(obs(table, 3.0, 0.001), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "candidates"


def test_the_floor_holds() -> None:
    decision = decide(obs(engines(3, 1), 3.0, 0.001), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "floor"
    config = replace(CONFIG, min_prefill=2)
    decision = decide(obs(engines(2, 2), 0.01, 1.0), ControlState(), config, SLO)
    assert decision.move is None and decision.reason == "floor"


def test_a_donor_projected_over_its_slo_holds() -> None:
    # Decode at 0.9 of its SLO with 2 engines: one fewer projects 1.8.
    decision = decide(obs(engines(2, 2), 5.0, 0.045), ControlState(), CONFIG, SLO)
    assert decision.move is None and decision.reason == "donor_slo"


def test_the_least_busy_candidate_moves() -> None:
    table = (
        EngineView("p0", Role.PREFILL, True),
        EngineView("d0", Role.DECODE, True, busy=7),
        EngineView("d1", Role.DECODE, True, busy=2),
        EngineView("d2", Role.DECODE, True, busy=5),
    )
    decision = decide(obs(table, 3.0, 0.001), ControlState(), CONFIG, SLO)
    assert decision.move is not None and decision.move.engine == "d1"


def test_the_next_move_waits_for_the_cooldown_and_a_settled_candidate() -> None:
    table = engines(1, 3)
    first = decide(obs(table, 3.0, 0.001), ControlState(), CONFIG, SLO)
    assert first.move is not None
    state = after(first, ControlState(), 100.0)
    assert state.last_move_at == 100.0
    table = apply(table, first, 100.0)
    # Still pressured on the new split (the loop shows only requests placed on it).
    held = decide(obs(table, 3.0, 0.001, now=103.0), state, CONFIG, SLO)
    assert held.move is None and held.reason == "cooldown"
    again = decide(obs(table, 3.0, 0.001, now=106.0), state, CONFIG, SLO)
    assert again.move is not None and again.move.new is Role.PREFILL


# Property tests ---------------------------------------------------------------------

views = st.builds(
    EngineView,
    id=st.sampled_from([f"e{i}" for i in range(8)]),
    role=st.sampled_from(list(Role)),
    capable=st.booleans(),
    pinned=st.booleans(),
    in_service=st.booleans(),
    since=st.floats(0, 200),
    busy=st.integers(0, 20),
)
tables = st.lists(views, min_size=1, max_size=8, unique_by=lambda e: e.id).map(tuple)
latency = st.one_of(st.none(), st.floats(0.0001, 20.0))
loads = st.builds(PhaseLoad, p90_s=latency, samples=st.integers(0, 100))
observations = st.builds(
    Observation, now=st.floats(0, 400), engines=tables, prefill=loads, decode=loads
)
configs = st.builds(
    ControllerConfig,
    enabled=st.just(True),
    dwell_s=st.floats(0, 100),
    cooldown_s=st.floats(0, 100),
    min_prefill=st.integers(1, 3),
    min_decode=st.integers(1, 3),
    ratio=st.floats(1.0, 3.0),
    min_pressure=st.floats(0, 2),
    min_samples=st.integers(1, 30),
)
states = st.builds(
    ControlState,
    last_move_at=st.one_of(st.none(), st.floats(0, 400)),
)


@given(observations, states, configs)
def test_every_move_respects_the_rules(
    observation: Observation, state: ControlState, config: ControllerConfig
) -> None:
    decision = decide(observation, state, config, SLO)
    move = decision.move
    if move is None:
        return
    engine = next(e for e in observation.engines if e.id == move.engine)
    # Only an unpinned, in-service role both engine, past its dwell, from its current role.
    assert engine.capable and not engine.pinned and engine.in_service
    assert observation.now - engine.since >= config.dwell_s
    assert engine.role is move.old and move.old is not Role.BOTH
    assert {move.old, move.new} == {Role.PREFILL, Role.DECODE}
    # Not within the cooldown.
    assert state.last_move_at is None or observation.now - state.last_move_at >= config.cooldown_s
    # Floors hold after the move.
    table = apply(observation.engines, decision, observation.now)
    assert serving(table, Role.PREFILL) >= min(
        config.min_prefill, serving(observation.engines, Role.PREFILL)
    )
    assert serving(table, Role.DECODE) >= min(
        config.min_decode, serving(observation.engines, Role.DECODE)
    )
    assert serving(table, move.old) >= (
        config.min_prefill if move.old is Role.PREFILL else config.min_decode
    )
    # Toward the pressured phase, and outside the band.
    assert observation.prefill.p90_s is not None and observation.decode.p90_s is not None
    pp = observation.prefill.p90_s / SLO.ttft_s
    pd = observation.decode.p90_s / SLO.tpot_s
    high, low = (pp, pd) if move.new is Role.PREFILL else (pd, pp)
    assert high >= low and high >= config.ratio * low and high >= config.min_pressure


@given(
    prefill=st.integers(1, 5),
    decode=st.integers(1, 5),
    ttft=st.floats(0.01, 10.0),
    tpot=st.floats(0.0005, 0.5),
    steps=st.integers(5, 60),
    config=configs,
)
def test_a_steady_observation_never_moves_engines_back_and_forth(
    prefill: int, decode: int, ttft: float, tpot: float, steps: int, config: ControllerConfig
) -> None:
    """However long the same latencies are reported, every move goes the same way, and
    the moves stop (at a floor, or where the donor would become the pressured phase)."""
    table = engines(prefill, decode)
    state = ControlState()
    directions = set()
    for step in range(steps + prefill + decode):  # enough to run out of engines to move
        now = 1000.0 + step * 200.0  # past any dwell and cooldown
        decision = decide(obs(table, ttft, tpot, now=now), state, config, SLO)
        if decision.move is not None:
            directions.add(decision.move.new)
            state = after(decision, state, now)
            table = apply(table, decision, now)
    assert len(directions) <= 1
    assert decide(obs(table, ttft, tpot, now=1e6), state, config, SLO).move is None


@given(observations, states, configs)
def test_at_most_one_engine_changes_per_decision(
    observation: Observation, state: ControlState, config: ControllerConfig
) -> None:
    decision = decide(observation, state, config, SLO)
    after_move = apply(observation.engines, decision, observation.now)
    changed = [a for a, b in zip(observation.engines, after_move, strict=True) if a != b]
    assert len(changed) == (0 if decision.move is None else 1)


def test_a_wait_for_the_consumers_first_token_is_decode_pressure() -> None:
    # The prefill leg is quick; requests wait 3 s after the descriptor for a place in a
    # full decode batch. That is decode's pressure (over the TTFT objective), not prefill's.
    observation = Observation(
        100.0, engines(2, 2), PhaseLoad(0.2, 50), PhaseLoad(0.01, 50, wait_p90_s=3.0)
    )
    decision = decide(observation, ControlState(), CONFIG, SLO)
    assert decision.move is not None and decision.move.new is Role.DECODE
    assert decision.reason == TOWARD_DECODE
    assert decision.inputs["first_token_wait_p90_s"] == 3.0
    assert decision.inputs["decode_pressure"] == 3.0


# Deep overload: evidence from requests without a first token ------------------------


def test_an_overloaded_prefill_moves_an_engine_though_nothing_reaches_decode() -> None:
    # No request reaches its first token: prefill's evidence is 30 requests waiting past
    # the objective, decode has no sample at all, and nothing waits for it.
    blind = Observation(100.0, engines(1, 3), PhaseLoad(12.0, 30, pending=30), PhaseLoad(None, 0))
    decision = decide(blind, ControlState(), CONFIG, SLO)
    assert decision.move is not None and decision.move.new is Role.PREFILL
    assert decision.inputs["idle"] == "decode" and decision.inputs["decode_pressure"] == 0.0
    # Without knowing decode's load, one engine only.
    assert decision.more == ()


def test_a_phase_without_samples_is_not_idle_while_work_waits_for_it() -> None:
    waiting_decode = [
        PhaseLoad(None, 0, waiting=3.0),
        PhaseLoad(None, 0, queue_time_s=2.0),
        PhaseLoad(None, 2, wait_p90_s=4.0, pending=2),
    ]
    for decode in waiting_decode:
        observation = Observation(100.0, engines(1, 3), PhaseLoad(12.0, 30, pending=30), decode)
        assert decide(observation, ControlState(), CONFIG, SLO).reason == "samples"
    # Nor is an overload that finished requests alone show idle beside it.
    few = Observation(100.0, engines(1, 3), PhaseLoad(12.0, 30), PhaseLoad(None, 0))
    assert decide(few, ControlState(), CONFIG, SLO).reason == "samples"


def test_pending_first_token_waits_are_decode_evidence() -> None:
    # Decode's batch is full: requests wait 5 s past their descriptors, few finish.
    observation = Observation(
        100.0,
        engines(3, 1),
        PhaseLoad(0.1, 40),
        PhaseLoad(None, 0, wait_p90_s=5.0, pending=20),
    )
    decision = decide(observation, ControlState(), CONFIG, SLO)
    assert decision.move is not None and decision.move.new is Role.DECODE


def test_the_engines_queue_time_is_a_floor_under_pressure() -> None:
    prefill = PhaseLoad(0.5, 50, queue_time_s=3.0)
    observation = Observation(100.0, engines(2, 2), prefill, PhaseLoad(0.01, 50))
    decision = decide(observation, ControlState(), CONFIG, SLO)
    assert decision.move is not None and decision.inputs["prefill_pressure"] == 3.0
    assert decision.inputs["prefill_queue_time_s"] == 3.0


def test_several_engines_worth_of_backlog_moves_several_engines() -> None:
    config = replace(CONFIG, max_moves=3)
    overloaded = PhaseLoad(8.0, 40, pending=30)
    observation = Observation(100.0, engines(1, 4), overloaded, PhaseLoad(0.005, 40))
    decision = decide(observation, ControlState(), config, SLO)
    assert len(decision.moves) == 3 and {m.new for m in decision.moves} == {Role.PREFILL}
    assert decision.inputs["engines_moved"] == 3
    table = apply_all(observation.engines, decision, 100.0)
    assert (serving(table, Role.PREFILL), serving(table, Role.DECODE)) == (4, 1)
    # The same backlog, but finished requests alone (no pending): one engine.
    calm = replace(observation, prefill=PhaseLoad(8.0, 40))
    assert len(decide(calm, ControlState(), config, SLO).moves) == 1


def test_a_multi_move_stops_where_the_other_phase_would_be_stranded() -> None:
    config = replace(CONFIG, max_moves=4)
    overloaded = PhaseLoad(8.0, 40, pending=30)
    # Decode at 0.3 of its SLO on 4 engines: 2 fewer is 0.6, 3 fewer 1.2 (over its SLO).
    observation = Observation(100.0, engines(1, 4), overloaded, PhaseLoad(0.015, 40))
    assert len(decide(observation, ControlState(), config, SLO).moves) == 2
    # The floor.
    floored = replace(config, min_decode=3)
    assert len(decide(observation, ControlState(), floored, SLO).moves) == 1
    # Only as many as the backlog needs: at 2.5 of its SLO, two engines more suffice.
    needs_two = replace(observation, prefill=PhaseLoad(2.5, 40, pending=30))
    light = replace(needs_two, decode=PhaseLoad(0.001, 40))
    assert len(decide(light, ControlState(), config, SLO).moves) == 2
    # Only settled candidates, and max_moves.
    fresh = replace(
        observation,
        decode=PhaseLoad(0.001, 40),
        engines=(*engines(1, 1), *_fresh_decoders(3)),
    )
    assert len(decide(fresh, ControlState(), config, SLO).moves) == 1
    single = replace(config, max_moves=1)
    assert len(decide(observation, ControlState(), single, SLO).moves) == 1


def _fresh_decoders(count: int) -> tuple[EngineView, ...]:
    return tuple(EngineView(f"f{i}", Role.DECODE, True, since=95.0) for i in range(count))


def apply_all(
    table: tuple[EngineView, ...], decision: Decision, now: float
) -> tuple[EngineView, ...]:
    moved = {m.engine: m.new for m in decision.moves}
    return tuple(replace(e, role=moved[e.id], since=now) if e.id in moved else e for e in table)
