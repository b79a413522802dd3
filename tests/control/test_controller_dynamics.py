"""The role controller over time, with its default timing keys: the real control loop, its
latency window and the role table, driven on a simulated clock by a fleet modelled as two
queues (each phase's latency grows as its engines fill).

The rules: a sustained shift gets its first move within 30 s; on steady demand the split
settles and then moves at most once, and never back and forth; pins and floors hold
throughout; advisory mode records the decisions the active mode takes on the same evidence.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import Config
from narwhal.control.controller import Decision, Observation
from narwhal.control.loop import ControlLoop
from narwhal.control.phase_latency import PhaseLatency, Sample
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.table import EngineEvent, Fleet, Phase

DEFAULTS = ControllerConfig(enabled=True)
SLO = SloConfig()  # TTFT 1 s, TPOT 50 ms
ARRIVALS_PER_S = 20
OUTPUT_TOKENS = 100


@dataclass(frozen=True, slots=True)
class Demand:
    """Engine-seconds of work per second for each phase: an engine of a phase serving
    `prefill` alone would be that busy."""

    prefill: float
    decode: float


def latency(base: float, work: float, engines: int) -> float:
    """A queue's latency at utilisation work/engines; past 97% it is as bad as it gets."""
    busy = min(work / engines, 0.97) if engines else 0.97
    return base / (1 - busy)


@dataclass
class Rig:
    """A fleet of `engines` role both engines (`pinned` among them), its control loop, and a
    clock that requests and decisions share."""

    start_prefill: int
    engines: int = 4
    pinned: frozenset[str] = frozenset()
    config: ControllerConfig = DEFAULTS
    seed: int = 0
    now: float = 0.0
    events: list[EngineEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        specs = tuple(
            EngineSpec(
                f"e{i}",
                f"http://10.0.0.{i + 1}:1",
                Role.BOTH,
                start_as=Role.PREFILL if i < self.start_prefill else Role.DECODE,
                pin=f"e{i}" in self.pinned,
            )
            for i in range(self.engines)
        )
        self.fleet = Fleet(specs)
        self.fleet.listeners.append(self.events.append)
        self.latency = PhaseLatency()
        self.loop = ControlLoop(
            self.fleet,
            FleetOperations(self.fleet, Config("m", specs), None),
            self.config,
            SLO,
            self.latency,
            clock=lambda: self.now,
        )
        self.rng = random.Random(self.seed)
        self.pending: list[Sample] = []
        self.moves: list[tuple[float, str, str]] = []

    def serving(self, phase: Phase) -> int:
        return sum(e.serves(phase) for e in self.fleet.engines)

    def run(self, until: float, demand: Callable[[float], Demand]) -> None:
        """Requests arrive every 1/ARRIVALS_PER_S s, timed by the split they arrive on;
        the loop decides every `interval_s`."""
        tick = 1 / ARRIVALS_PER_S
        next_decision = self.now + self.config.interval_s
        while self.now < until:
            self.now = round(self.now + tick, 6)
            self._arrive(demand(self.now))
            self._finish()
            if self.now >= next_decision:
                next_decision += self.config.interval_s
                decision = self.loop.step(self.now)
                if decision.move is not None and not self.config.advisory:
                    self.moves.append((self.now, decision.move.engine, decision.move.new.value))
                self.check_pins_and_floors()

    def check_pins_and_floors(self) -> None:
        for engine in self.fleet.engines:
            if engine.pinned:
                assert engine.role is engine.spec.start_as, f"pinned {engine.id} moved"
        assert self.serving(Phase.PREFILL) >= self.config.min_prefill
        assert self.serving(Phase.DECODE) >= self.config.min_decode

    def _arrive(self, demand: Demand) -> None:
        jitter = self.rng.uniform
        prefill = latency(0.1, demand.prefill, self.serving(Phase.PREFILL)) * jitter(0.7, 1.3)
        tpot = latency(0.01, demand.decode, self.serving(Phase.DECODE)) * jitter(0.7, 1.3)
        wait = 0.01 * jitter(0.7, 1.3)
        finished = self.now + prefill + wait + tpot * (OUTPUT_TOKENS - 1)
        self.pending.append(Sample(self.now, finished, prefill, wait, tpot))

    def _finish(self) -> None:
        done = [s for s in self.pending if s.finished <= self.now]
        self.pending = [s for s in self.pending if s.finished > self.now]
        for sample in done:
            self.latency.record(sample)


def steady(demand: Demand) -> Callable[[float], Demand]:
    return lambda _: demand


def shift(at: float, before: Demand, after: Demand) -> Callable[[float], Demand]:
    return lambda now: before if now < at else after


BALANCED = Demand(prefill=0.8, decode=0.8)  # 2P2D at 40% each
PREFILL_HEAVY = Demand(prefill=2.0, decode=0.3)
DECODE_HEAVY = Demand(prefill=0.3, decode=2.0)


@pytest.mark.parametrize(
    ("after", "toward"), [(PREFILL_HEAVY, "prefill"), (DECODE_HEAVY, "decode")]
)
def test_a_sustained_shift_gets_its_first_move_within_30_s(after: Demand, toward: str) -> None:
    rig = Rig(start_prefill=2)
    rig.run(300.0, steady(BALANCED))  # past the dwell time, settled
    assert rig.moves == []
    rig.run(400.0, shift(300.0, BALANCED, after))
    assert rig.moves, "no move after the shift"
    first_at, _, to = rig.moves[0]
    assert to == toward
    assert first_at - 300.0 <= 30.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("demand", "start"),
    [
        (PREFILL_HEAVY, 1),
        (PREFILL_HEAVY, 2),
        (DECODE_HEAVY, 3),
        (DECODE_HEAVY, 2),
        (BALANCED, 2),
        (BALANCED, 1),
        (BALANCED, 3),
        (Demand(prefill=1.3, decode=1.3), 2),
    ],
)
def test_steady_demand_settles_and_then_moves_at_most_once(
    demand: Demand, start: int, seed: int
) -> None:
    rig = Rig(start_prefill=start, seed=seed)
    rig.run(1800.0, steady(demand))
    settled = [move for move in rig.moves if move[0] > 600.0]
    assert len(settled) <= 1, rig.moves
    # Never back and forth: every move goes the same way.
    assert len({to for _, _, to in rig.moves}) <= 1, rig.moves


def test_pins_and_floors_hold_while_demand_swings() -> None:
    config = ControllerConfig(enabled=True, min_prefill=2, min_decode=1)
    rig = Rig(start_prefill=3, engines=6, pinned=frozenset({"e0", "e5"}), config=config)
    for cycle in range(4):  # 10 minutes each way, checked at every decision
        start = cycle * 1200.0
        rig.run(start + 600.0, steady(Demand(prefill=0.3, decode=4.0)))
        rig.run(start + 1200.0, steady(Demand(prefill=4.0, decode=0.3)))
    assert {to for _, _, to in rig.moves} == {"prefill", "decode"}
    assert all(engine not in ("e0", "e5") for _, engine, _ in rig.moves)


def test_advisory_mode_records_the_decisions_the_active_mode_takes_on_the_same_evidence() -> None:
    active = Rig(start_prefill=2)
    advisory = Rig(start_prefill=2, config=ControllerConfig(enabled=True, advisory=True))
    # The advisory loop is shown what the active one sees, at the same moments.
    seen: list[Observation] = []

    def observed(now: float) -> Observation:
        seen.append(active.loop.observe(now))
        return seen[-1]

    active.loop.source = observed
    advisory.loop.source = lambda _: seen[-1]
    decisions: list[tuple[Decision, Decision]] = []
    original = active.loop.step

    def both(now: float) -> Decision:
        mine = original(now)
        decisions.append((mine, advisory.loop.step(now)))
        return mine

    active.loop.step = both  # type: ignore[method-assign]
    demand = shift(300.0, PREFILL_HEAVY, DECODE_HEAVY)
    active.run(900.0, demand)
    assert len(active.moves) >= 2
    assert all(a == b for a, b in decisions)
    changes = [e for e in active.events if e.kind == "role_change"]
    advice = [e for e in advisory.events if e.kind == "role_advice"]
    assert [(e.engine, e.reason, e.inputs) for e in changes] == [
        (e.engine, e.reason, e.inputs) for e in advice
    ]
    # And it changed nothing.
    assert [e.role for e in advisory.fleet.engines] == [
        Role.PREFILL,
        Role.PREFILL,
        Role.DECODE,
        Role.DECODE,
    ]
    assert advisory.loop.summary()["moves"] == {}
    assert sum(advisory.loop.summary()["advice"].values()) == len(changes)
