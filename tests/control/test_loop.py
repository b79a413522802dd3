"""The control loop over a fake observation source: moves applied through operations,
advice journaled and nothing applied, pins and refusals respected, state and metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import Config
from narwhal.control.controller import TOWARD_PREFILL, Observation, PhaseLoad
from narwhal.control.loop import ControlLoop, split
from narwhal.control.phase_latency import PhaseLatency, Sample
from narwhal.engines.scrape import EngineReport
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.operations import FleetOperations, OperationError
from narwhal.fleet.table import EngineEvent, Fleet, Phase
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call, Stage

SPECS = (
    EngineSpec("a", "http://10.0.0.1:1", Role.BOTH, start_as=Role.PREFILL),
    EngineSpec("b", "http://10.0.0.2:1", Role.BOTH, start_as=Role.DECODE),
    EngineSpec("c", "http://10.0.0.3:1", Role.BOTH, start_as=Role.DECODE),
    EngineSpec("d", "http://10.0.0.4:1", Role.BOTH, start_as=Role.DECODE, pin=True),
)
CONFIG = ControllerConfig(enabled=True, dwell_s=0.0, cooldown_s=0.0, min_samples=1)
SLO = SloConfig(ttft_s=1.0, tpot_s=0.05)


class Rig:
    def __init__(self, config: ControllerConfig = CONFIG, *, ttft: float = 4.0) -> None:
        self.fleet = Fleet(SPECS)
        self.events: list[EngineEvent] = []
        self.fleet.listeners.append(self.events.append)
        self.ops = FleetOperations(self.fleet, Config("m", SPECS), None)
        self.ttft, self.tpot = ttft, 0.001
        self.loop = ControlLoop(
            self.fleet, self.ops, config, SLO, PhaseLatency(), source=self.observation
        )

    def observation(self, now: float) -> Observation:
        real = self.loop.observe(now)
        return replace(real, prefill=PhaseLoad(self.ttft, 50), decode=PhaseLoad(self.tpot, 50))

    def roles(self) -> dict[str, str]:
        return {e.id: e.role.value for e in self.fleet.engines}


def test_start_as_sets_the_starting_role_and_pin_the_pin() -> None:
    rig = Rig()
    assert rig.roles() == {"a": "prefill", "b": "decode", "c": "decode", "d": "decode"}
    assert rig.fleet.by_id["d"].pinned
    assert [e.id for e in rig.fleet.admitted(Phase.PREFILL, 0.0)] == ["a"]


def test_a_move_is_applied_through_operations_and_journaled() -> None:
    rig = Rig()
    decision = rig.loop.step(100.0)
    assert decision.move is not None and decision.reason == TOWARD_PREFILL
    moved = rig.fleet.by_id[decision.move.engine]
    assert moved.id in ("b", "c") and moved.role is Role.PREFILL
    assert moved.role_since == 100.0
    event = next(e for e in rig.events if e.kind == "role_change")
    assert event.engine == moved.id and event.reason == TOWARD_PREFILL
    assert event.inputs is not None and event.inputs["ttft_p90_s"] == 4.0
    assert "decode -> prefill" in event.detail
    summary = rig.loop.summary()
    assert summary["split"] == {"prefill": 2, "decode": 2, "both": 0}
    assert summary["moves"] == {TOWARD_PREFILL: 1}
    assert summary["last_decision"]["move"]["to"] == "prefill"
    assert summary["timeline"][0]["applied"] is True


def test_advisory_decides_the_same_and_applies_nothing() -> None:
    real, advisory = Rig(), Rig(replace(CONFIG, advisory=True))
    applied = real.loop.step(100.0)
    advised = advisory.loop.step(100.0)
    assert advised.move == applied.move and advised.reason == applied.reason
    assert advisory.roles() == {"a": "prefill", "b": "decode", "c": "decode", "d": "decode"}
    assert [e.kind for e in advisory.events] == ["role_advice"]
    assert advisory.loop.summary()["advice"] == {TOWARD_PREFILL: 1}
    assert advisory.loop.summary()["moves"] == {}


def test_the_pinned_engine_never_moves() -> None:
    rig = Rig()
    for step in range(20):
        rig.ttft = 4.0 + step  # fresh evidence every step
        rig.loop.step(100.0 + step)
    assert rig.fleet.by_id["d"].role is Role.DECODE
    # Floors: one decode engine (the pinned one) stays.
    assert sum(e.serves(Phase.DECODE) for e in rig.fleet.engines) >= 1


def test_a_refused_move_changes_nothing() -> None:
    rig = Rig()
    rig.fleet.by_id["b"].pinned = True  # pinned between observation and move
    rig.loop.source = lambda now: replace(
        rig.observation(now),
        engines=tuple(
            replace(v, pinned=False) if v.id == "b" else replace(v, busy=99)
            for v in rig.loop.observe(now).engines
        ),
    )
    decision = rig.loop.step(100.0)
    assert decision.move is not None and decision.move.engine == "b"
    assert rig.fleet.by_id["b"].role is Role.DECODE
    assert rig.loop.summary()["moves"] == {}


async def test_an_operator_role_change_ends_the_acting_role() -> None:
    rig = Rig()
    rig.ops.patch("a", {"role": "decode"}, force=True)
    assert rig.fleet.by_id["a"].role is Role.DECODE and rig.fleet.by_id["a"].acting is None
    assert split(rig.fleet)["prefill"] == 0


def test_operations_refuse_moves_of_pinned_fixed_role_engines_and_at_floors() -> None:
    specs = (
        EngineSpec("a", "http://10.0.0.1:1", Role.BOTH, start_as=Role.PREFILL),
        EngineSpec("b", "http://10.0.0.2:1", Role.DECODE),
        EngineSpec("c", "http://10.0.0.3:1", Role.BOTH, start_as=Role.DECODE, pin=True),
    )
    fleet = Fleet(specs)
    ops = FleetOperations(fleet, Config("m", specs), None)
    refused = []
    for engine, role in (("b", Role.PREFILL), ("c", Role.PREFILL), ("a", Role.DECODE)):
        try:
            ops.move(engine, role, "test", now=1.0)
        except OperationError as error:
            refused.append((engine, error.status, error.message))
    assert [(e, s) for e, s, _ in refused] == [("b", 409), ("c", 409), ("a", 409)]
    assert "pinned" in refused[1][2]
    assert "no admitted engine to prefill" in refused[2][2]
    assert [e.role for e in fleet.engines] == [Role.PREFILL, Role.DECODE, Role.DECODE]


def test_after_a_move_only_requests_that_arrived_since_count() -> None:
    fleet = Fleet(SPECS)
    latency = PhaseLatency()
    loop = ControlLoop(
        fleet, FleetOperations(fleet, Config("m", SPECS), None), CONFIG, SLO, latency
    )
    moved_at = time.perf_counter()
    for i in range(30):  # placed on the old split: slow prefills
        latency.record(Sample(moved_at - 3.0, moved_at - 1.0 + i / 100, 4.0, 0.01, 0.001))
    assert loop.step(moved_at).move is not None
    # The same slow requests are no evidence about the new split.
    held = loop.step(time.perf_counter())
    assert held.move is None and held.reason == "samples"
    for _ in range(30):  # arrived after the move, still slow: evidence again
        latency.record(Sample(moved_at + 0.001, time.perf_counter(), 6.0, 0.01, 0.001))
    assert loop.step(time.perf_counter()).move is not None


def overloaded(rig: Rig) -> Callable[[float], Observation]:
    """Requests pile up past the TTFT objective and none reaches decode."""

    def observation(now: float) -> Observation:
        real = rig.loop.observe(now)
        return replace(real, prefill=PhaseLoad(9.0, 40, pending=40), decode=PhaseLoad(0.001, 40))

    return observation


def test_an_overload_moves_several_engines_in_one_decision() -> None:
    rig = Rig()
    rig.loop.source = overloaded(rig)
    decision = rig.loop.step(100.0)
    assert [m.engine for m in decision.moves] == ["b", "c"]  # not the pinned d
    assert rig.roles() == {"a": "prefill", "b": "prefill", "c": "prefill", "d": "decode"}
    changes = [e for e in rig.events if e.kind == "role_change"]
    assert [e.engine for e in changes] == ["b", "c"]
    assert all(e.inputs is not None and e.inputs["engines_moved"] == 2 for e in changes)
    summary = rig.loop.summary()
    assert summary["moves"] == {TOWARD_PREFILL: 2}
    assert [(t["engine"], t["to"]) for t in summary["timeline"]] == [
        ("b", "prefill"),
        ("c", "prefill"),
    ]
    # One decision: the cooldown starts once for both.
    assert rig.loop.state.last_move_at == 100.0
    advisory = Rig(replace(CONFIG, advisory=True))
    advisory.loop.source = overloaded(advisory)
    advised = advisory.loop.step(100.0)
    assert advised == decision
    assert [e.kind for e in advisory.events] == ["role_advice", "role_advice"]
    assert advisory.roles()["b"] == "decode" and advisory.loop.summary()["advice"] == {
        TOWARD_PREFILL: 2
    }


def test_requests_waiting_for_their_first_token_are_the_loops_evidence() -> None:
    fleet = Fleet(SPECS)
    latency = PhaseLatency()
    config = replace(CONFIG, min_samples=20)
    loop = ControlLoop(
        fleet, FleetOperations(fleet, Config("m", SPECS), None), config, SLO, latency
    )
    assert loop.step(100.0).reason == "samples"
    now = time.perf_counter()
    for i in range(25):  # 5 to 10 s in the producer's queue, none at its first token
        call = Call(f"r{i}", None, Endpoint.COMPLETIONS, arrival=now - 5.0 - i / 5, deadline=1e9)
        call.stage = Stage.PREFILL
        latency.arrived(call)
    decision = loop.step(100.0)
    assert decision.move is not None and decision.move.new is Role.PREFILL
    assert decision.inputs["prefill_pending"] == 25 and decision.inputs["idle"] == "decode"
    ttft = decision.inputs["ttft_p90_s"]
    assert isinstance(ttft, float) and ttft > 8.0


def test_the_engines_mean_queue_time_since_the_last_observation() -> None:
    rig = Rig()
    producer, consumer = rig.fleet.by_id["a"], rig.fleet.by_id["b"]
    producer.report = EngineReport(queue_time_sum=10.0, queue_time_count=5.0)
    consumer.report = EngineReport(queue_time_sum=1.0, queue_time_count=10.0)
    first = rig.loop.observe(100.0)  # the first reading only sets the marks
    assert first.prefill.queue_time_s is None and first.decode.queue_time_s is None
    producer.report = EngineReport(queue_time_sum=40.0, queue_time_count=15.0)
    second = rig.loop.observe(105.0)
    assert second.prefill.queue_time_s == 3.0  # 30 s over 10 requests
    assert second.decode.queue_time_s is None  # nobody left the consumer's queue
    producer.report = EngineReport(queue_time_sum=2.0, queue_time_count=1.0)  # restarted
    assert rig.loop.observe(110.0).prefill.queue_time_s == 2.0


# Several pools: each decided on its own engines, latencies and objectives ----------------

POOLS = (
    EngineSpec("a1", "http://10.0.1.1:1", Role.BOTH, start_as=Role.PREFILL, model="a"),
    EngineSpec("a2", "http://10.0.1.2:1", Role.BOTH, start_as=Role.DECODE, model="a"),
    EngineSpec("a3", "http://10.0.1.3:1", Role.BOTH, start_as=Role.DECODE, model="a"),
    EngineSpec("b1", "http://10.0.2.1:1", Role.BOTH, start_as=Role.PREFILL, model="b"),
    EngineSpec("b2", "http://10.0.2.2:1", Role.BOTH, start_as=Role.DECODE, model="b"),
    EngineSpec("b3", "http://10.0.2.3:1", Role.BOTH, start_as=Role.DECODE, model="b"),
)


def pooled(model_slo: dict[str, SloConfig] | None = None) -> tuple[ControlLoop, PhaseLatency]:
    fleet = Fleet(POOLS, catalog=Catalog("a", {"b": Target("b")}))
    latency = PhaseLatency()
    ops = FleetOperations(fleet, Config("a", POOLS), None)
    return ControlLoop(fleet, ops, CONFIG, SLO, latency, model_slo=model_slo), latency


def slow_prefills(latency: PhaseLatency, model: str, prefill_s: float) -> None:
    now = time.perf_counter()
    for i in range(10):
        latency.record(Sample(now - 2.0, now - 1.0 + i / 100, prefill_s, 0.01, 0.001, model))


def pool_roles(loop: ControlLoop, model: str) -> list[str]:
    return [e.role.value for e in loop.fleet.pool(model)]


def test_each_pool_is_decided_on_its_own_requests_and_moves_only_its_engines() -> None:
    loop, latency = pooled()
    slow_prefills(latency, "a", 4.0)  # pool a's prefills are four times their objective
    slow_prefills(latency, "b", 0.1)  # pool b's are well within theirs
    decision = loop.step(100.0)
    assert decision.move is not None and decision.move.engine in ("a2", "a3")
    assert decision.detail.startswith("model `a`: prefill pressure 4.00")
    assert sorted(pool_roles(loop, "a")) == ["decode", "prefill", "prefill"]
    assert pool_roles(loop, "b") == ["prefill", "decode", "decode"]
    # Pool b held on its own evidence; each pool keeps its own memory.
    assert loop.last_by_model["b"].move is None
    assert loop.last_by_model["b"].reason == "objectives"
    assert loop.states["a"].last_move_at == 100.0 and "b" not in loop.states
    summary = loop.summary()
    assert summary["timeline"][0]["model"] == "a"
    assert summary["pools"]["b"]["last_decision"]["reason"] == "objectives"
    assert summary["pools"]["a"]["last_decision"]["move"]["to"] == "prefill"


def test_a_pool_takes_its_models_own_objectives() -> None:
    # The same slow prefills in both pools; model b's own TTFT objective is looser.
    loop, latency = pooled({"b": SloConfig(ttft_s=10.0, tpot_s=0.05)})
    slow_prefills(latency, "a", 4.0)
    slow_prefills(latency, "b", 4.0)
    loop.step(100.0)
    assert sorted(pool_roles(loop, "a")) == ["decode", "prefill", "prefill"]
    assert pool_roles(loop, "b") == ["prefill", "decode", "decode"]
    held = loop.last_by_model["b"]
    assert held.move is None and held.inputs["prefill_pressure"] == 0.4
    assert loop.summary()["pools"]["b"]["slo"] == {"ttft_s": 10.0, "tpot_s": 0.05}
