"""The role controller over time, with its default timing keys: the real control loop, its
latency window and the role table, driven on a simulated clock by a fleet modelled as two
queues (each phase's latency grows as its engines fill).

The rules: a sustained shift gets its first move within 30 s; on steady demand the split
settles and then moves at most once, and never back and forth; pins and floors hold
throughout; advisory mode records the decisions the active mode takes on the same evidence.

Deep overload has its own model, request by request: prompts several times one producer's
capacity on a 1P+3D start, so that every prompt waits past the KV lease and no request
reaches its first token; the controller moves engines on the evidence of requests still
waiting and handoffs that expired, and moves one back when decode-heavy load follows.
"""

from __future__ import annotations

import heapq
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
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call, Stage

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


# Deep overload: a fleet modelled request by request -----------------------------------

LEASE_S = 25.0  # a descriptor older than this is refused: 504 handoff_expired


@dataclass
class Producer:
    """One engine's prefill queue, processor-shared: each of the `n` prompts on it gets
    1/n of the engine, so an overloaded producer slows every prompt on it, and a request
    finishes once the service every prompt got since it arrived (`attained`) is its own."""

    attained: float = 0.0
    heap: list[tuple[float, int, Call]] = field(default_factory=list)


@dataclass
class OverloadRig:
    """Four role both engines on a 1P+3D start (all pinned for the static control), with
    requests fed to the controller as the router feeds it: each arrives (and waits without
    a first token while its prompt is on a producer), gets its first token or, when its
    descriptor is past the lease, ends as an expired handoff, and ends."""

    pinned: bool = False
    config: ControllerConfig = DEFAULTS
    now: float = 0.0
    seq: int = 0

    def __post_init__(self) -> None:
        specs = tuple(
            EngineSpec(
                f"e{i}",
                f"http://10.0.0.{i + 1}:1",
                Role.BOTH,
                start_as=Role.PREFILL if i == 0 else Role.DECODE,
                pin=self.pinned,
            )
            for i in range(4)
        )
        self.fleet = Fleet(specs)
        self.latency = PhaseLatency()
        self.loop = ControlLoop(
            self.fleet,
            FleetOperations(self.fleet, Config("m", specs), None),
            self.config,
            SLO,
            self.latency,
            clock=lambda: self.now,
        )
        self.rng = random.Random(0)
        self.producers = {e.id: Producer() for e in self.fleet.engines}
        self.decoding: list[tuple[float, int, str, Call]] = []
        self.moves: list[tuple[float, str, str]] = []
        # (arrival, whether its first token met the TTFT objective and its decode TPOT's)
        self.served: list[tuple[float, bool]] = []
        self.blind_at_first_decision: bool | None = None

    def split(self) -> tuple[int, int]:
        roles = [e.role for e in self.fleet.engines]
        return roles.count(Role.PREFILL), roles.count(Role.DECODE)

    def run(self, until: float, demand: Callable[[float], Demand]) -> None:
        tick = 1 / ARRIVALS_PER_S
        next_decision = self.now + self.config.interval_s
        while self.now < until:
            self.now = round(self.now + tick, 6)
            self._prefill(tick)
            self._arrive(demand(self.now))
            self._decode(demand(self.now))
            if self.now >= next_decision:
                next_decision += self.config.interval_s
                if self.blind_at_first_decision is None and self.now >= self.config.dwell_s:
                    # What finished requests alone show (the evidence before pending work).
                    old = self.latency.window(self.now, self.config.window_s)
                    self.blind_at_first_decision = old.prefill.samples < self.config.min_samples
                decision = self.loop.step(self.now)
                self.moves += [(self.now, m.engine, m.new.value) for m in decision.moves]

    def _arrive(self, demand: Demand) -> None:
        self.seq += 1
        call = Call(f"r{self.seq}", None, Endpoint.COMPLETIONS, arrival=self.now, deadline=1e9)
        call.stage = Stage.PREFILL
        self.latency.arrived(call)
        # Placement: the producer with the fewest prompts on it.
        producing = [e.id for e in self.fleet.engines if e.serves(Phase.PREFILL)]
        producer = self.producers[min(producing, key=lambda p: len(self.producers[p].heap))]
        work = demand.prefill / ARRIVALS_PER_S * self.rng.uniform(0.7, 1.3)
        heapq.heappush(producer.heap, (producer.attained + work, self.seq, call))

    def _prefill(self, tick: float) -> None:
        for producer in self.producers.values():
            if not producer.heap:
                continue
            producer.attained += tick / len(producer.heap)
            while producer.heap and producer.heap[0][0] <= producer.attained:
                _, seq, call = heapq.heappop(producer.heap)
                call.ttft_s = self.now - call.arrival
                if call.ttft_s > LEASE_S:
                    call.stage, call.status, call.cause = Stage.HANDOFF, 504, "handoff_expired"
                    self.latency.add(call, self.now)
                    self.served.append((call.arrival, False))
                    continue
                call.stage = Stage.DECODE
                heapq.heappush(self.decoding, (self.now + 0.01, seq, "first", call))

    def _decode(self, demand: Demand) -> None:
        consumers = sum(e.serves(Phase.DECODE) for e in self.fleet.engines)
        while self.decoding and self.decoding[0][0] <= self.now:
            _, seq, kind, call = heapq.heappop(self.decoding)
            if kind == "first":
                call.first_byte_s = self.now - call.arrival
                self.latency.first_token(call, self.now)
                tpot = latency(0.01, demand.decode, consumers) * self.rng.uniform(0.7, 1.3)
                met = call.first_byte_s <= SLO.ttft_s and tpot <= SLO.tpot_s
                self.served.append((call.arrival, met))
                ends = self.now + tpot * (OUTPUT_TOKENS - 1)
                heapq.heappush(self.decoding, (ends, seq, "end", call))
            else:
                call.status, call.output_tokens, call.stage = 200, OUTPUT_TOKENS, Stage.RELAY
                self.latency.add(call, self.now)

    def goodput(self, since: float, until: float) -> float:
        """Requests per second that arrived in [since, until) and met both objectives."""
        return sum(met for at, met in self.served if since <= at < until) / (until - since)


SATURATED = Demand(prefill=2.5, decode=0.3)  # two and a half producers' worth
DECODE_AFTER = Demand(prefill=0.3, decode=2.5)


def test_a_saturated_prefill_moves_engines_though_no_request_reaches_its_first_token() -> None:
    rig, pinned = OverloadRig(), OverloadRig(pinned=True)
    for each in (rig, pinned):
        each.run(450.0, steady(SATURATED))
    # By the first decision an engine may move (past the dwell time), finished requests
    # alone show nothing: every prompt on the producer waits past the lease.
    assert rig.blind_at_first_decision is True
    assert pinned.moves == [] and pinned.split() == (1, 3)
    assert rig.moves, "no move under a saturated prefill"
    first_at = rig.moves[0][0]
    assert first_at - DEFAULTS.dwell_s <= 30.0
    assert all(to == "prefill" for _, _, to in rig.moves), rig.moves  # never back
    assert rig.split() == (3, 1)
    # Goodput in the run's last third beats the pinned 1P+3D run's.
    assert rig.goodput(300.0, 450.0) > max(2 * pinned.goodput(300.0, 450.0), 1.0)
    # Then decode-heavy load moves an engine back.
    rig.run(750.0, steady(DECODE_AFTER))
    back = [move for move in rig.moves if move[0] > 450.0]
    assert back and back[0][2] == "decode", rig.moves
    assert all(to == "decode" for _, _, to in back)
