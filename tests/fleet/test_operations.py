"""Operators' changes to a live fleet, and how drains meet the breaker and readmission."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import Config, RecoveryConfig, RestartPolicy
from narwhal.engines.client import EngineClient
from narwhal.fleet.breaker import Breaker
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.operations import FleetOperations, OperationError, floor_breach
from narwhal.fleet.readmission import FAILURE, SUCCESS, Readmission, Verdict
from narwhal.fleet.table import NOT_YET_PROBED, Engine, EngineEvent, Fleet, Phase
from narwhal.protocol.errors import Cause, NarwhalError, engine_error

SPECS = (
    EngineSpec("p0", "http://10.0.0.1:1", Role.PREFILL),
    EngineSpec("p1", "http://10.0.0.2:1", Role.PREFILL),
    EngineSpec("d0", "http://10.0.0.3:1", Role.DECODE),
    EngineSpec("d1", "http://10.0.0.4:1", Role.DECODE),
)


class Ops:
    """A fleet, its operations and every event they emitted."""

    def __init__(self, specs: tuple[EngineSpec, ...] = SPECS, path: Path | None = None) -> None:
        self.config = Config("m", specs)
        self.fleet = Fleet(specs)
        self.events: list[EngineEvent] = []
        self.fleet.listeners.append(self.events.append)
        self.ops = FleetOperations(self.fleet, self.config, path)

    def kinds(self, engine: str | None = None) -> list[str]:
        return [e.kind for e in self.events if engine is None or e.engine == engine]

    def state(self, engine: str) -> str:
        return self.fleet.by_id[engine].state(asyncio.get_running_loop().time()).value

    def eject(self, engine: str) -> None:
        """As the breaker would (its `ejected` event included)."""
        self.fleet.by_id[engine].lifecycle.apply(Event.EJECT, self.fleet.emit, "by the test")

    def readmit(self, engine: str) -> None:
        """As readmission would."""
        self.fleet.by_id[engine].lifecycle.apply(Event.READMIT, self.fleet.emit)


def refused(status: int, action: Any, *args: Any, **kwargs: Any) -> OperationError:
    with pytest.raises(OperationError) as caught:
        action(*args, **kwargs)
    assert caught.value.status == status, caught.value.message
    return caught.value


# Drain ----------------------------------------------------------------------------------


async def test_an_idle_engine_drains_at_once() -> None:
    t = Ops()
    t.ops.drain("d0")
    assert t.state("d0") == "drained"
    assert t.kinds("d0") == ["draining", "drained"]


async def test_a_busy_engine_is_draining_until_its_last_seat_is_released() -> None:
    t = Ops((SPECS[0], SPECS[2], SPECS[3]))
    held = [t.fleet.try_reserve() for _ in range(4)]
    on_d0 = [r for r in held if r is not None and r.consumer.id == "d0"]
    assert on_d0
    t.ops.drain("d0")
    assert t.state("d0") == "draining"
    # No new work: every further placement goes to d1.
    for _ in range(5):
        reservation = t.fleet.try_reserve()
        assert reservation is not None and reservation.consumer.id == "d1"
    for reservation in on_d0[:-1]:
        reservation.release()
    assert t.state("d0") == "draining" and "drained" not in t.kinds("d0")
    on_d0[-1].release()
    assert t.state("d0") == "drained"
    assert t.kinds("d0") == ["draining", "drained"]


@pytest.mark.parametrize(("engine", "phase"), [("d0", "decode"), ("p0", "prefill")])
async def test_draining_the_last_engine_of_a_phase_is_refused_unless_forced(
    engine: str, phase: str
) -> None:
    t = Ops((SPECS[0], SPECS[2]))
    error = refused(409, t.ops.drain, engine)
    assert f"no admitted engine to {phase}" in error.message and "?force=true" in error.message
    assert t.state(engine) == "admitted" and t.events == []
    t.ops.drain(engine, force=True)
    assert t.state(engine) == "drained"
    assert f"forced: no other admitted {phase} engine" in t.events[0].detail


async def test_an_ejected_or_drained_peer_does_not_hold_the_floor_a_quarantined_one_does() -> None:
    t = Ops()
    t.eject("d1")
    refused(409, t.ops.drain, "d0")
    t.readmit("d1")
    t.ops.drain("d1")
    refused(409, t.ops.drain, "d0")
    t.ops.readmit("d1")
    t.fleet.quarantine(t.fleet.by_id["d1"], 5.0, "test")
    t.ops.drain("d0")
    assert t.state("d0") == "drained"


async def test_an_engine_serving_both_phases_keeps_both_floors() -> None:
    both = EngineSpec("b0", "http://10.0.0.5:1", Role.BOTH)
    t = Ops((both, SPECS[2]))
    error = refused(409, t.ops.drain, "b0")
    assert "to prefill" in error.message
    now = 0.0
    assert floor_breach(t.fleet, t.fleet.by_id["b0"], (Phase.DECODE,), now) is None


async def test_a_second_drain_and_unknown_engines_are_refused() -> None:
    t = Ops()
    t.ops.drain("d0")
    assert "already drained" in refused(409, t.ops.drain, "d0").message
    for action in (t.ops.drain, t.ops.readmit, t.ops.delete):
        assert "no engine 'x9'" in refused(404, action, "x9").message
    refused(404, t.ops.patch, "x9", {"pin": True})


# Readmit and delete ---------------------------------------------------------------------


async def test_readmit_ends_a_drain_and_only_a_drain() -> None:
    t = Ops()
    error = refused(409, t.ops.readmit, "d0")
    assert "is admitted, not drained" in error.message
    t.ops.drain("d0")
    t.ops.readmit("d0")
    assert t.state("d0") == "admitted"
    assert t.kinds("d0") == ["draining", "drained", "readmitted"]


async def test_readmitting_a_drained_ejected_engine_leaves_it_to_readmission() -> None:
    t = Ops()
    t.eject("d0")
    t.ops.drain("d0", force=True)
    t.ops.readmit("d0")
    assert t.state("d0") == "ejected"
    assert "still ejected" in t.events[-1].detail


async def test_delete_needs_a_drained_idle_engine() -> None:
    t = Ops()
    assert "drain it first" in refused(409, t.ops.delete, "d0").message
    reservation = t.fleet.try_reserve()
    assert reservation is not None
    busy = reservation.consumer.id
    t.ops.drain(busy)
    assert "still draining" in refused(409, t.ops.delete, busy).message
    reservation.release()
    t.ops.delete(busy)
    assert busy not in t.fleet.by_id and all(e.id != busy for e in t.fleet.engines)
    assert t.kinds(busy) == ["draining", "drained", "removed"]


# Add and patch --------------------------------------------------------------------------


class Judge:
    """Readmission over the fleet, its probe replaced by a verdict kept per engine."""

    def __init__(self, t: Ops, client: EngineClient) -> None:
        self.readmission = Readmission(t.config, t.fleet, client)
        self.judged: list[str] = []
        self.verdict = Verdict(SUCCESS, "probe passed")

        async def judge(engine: Engine) -> Verdict:
            self.judged.append(engine.id)
            return self.verdict

        self.readmission.judge = judge  # type: ignore[method-assign]


async def test_an_added_engine_is_probed_before_it_is_placed_on() -> None:
    t = Ops((SPECS[0], SPECS[2]))
    async with EngineClient() as client:
        judge = Judge(t, client)
        t.ops.add({"id": "d9", "url": "http://10.0.0.9:1", "role": "decode"})
        d9 = t.fleet.by_id["d9"]
        assert t.state("d9") == "ejected" and d9.ejection_reason == NOT_YET_PROBED
        assert t.kinds() == ["added"] and "decode at http://10.0.0.9:1" in t.events[0].detail
        assert judge.readmission._wake.is_set(), "judged at once, not at the next tick"
        for _ in range(4):
            reservation = t.fleet.try_reserve()
            assert reservation is not None and reservation.consumer.id == "d0"
            reservation.release()
        await judge.readmission.tick()
        assert judge.judged == ["d9"] and t.state("d9") == "admitted"
        assert t.kinds("d9") == ["added", "probe", "readmitted"]
        t.ops.drain("d0")
        reservation = t.fleet.try_reserve()
        assert reservation is not None and reservation.consumer.id == "d9"


async def test_an_added_engine_that_fails_its_probe_stays_out() -> None:
    t = Ops((SPECS[0], SPECS[2]))
    async with EngineClient() as client:
        judge = Judge(t, client)
        judge.verdict = Verdict(FAILURE, "/health answered HTTP 404")
        t.ops.add({"id": "d9", "url": "http://10.0.0.9:1", "role": "decode"})
        await judge.readmission.tick()
        assert t.state("d9") == "ejected"
        refused(409, t.ops.drain, "d0")  # d9 is no other engine in service for decode


async def test_an_added_engine_serves_a_waiter_once_probed() -> None:
    t = Ops((SPECS[0], EngineSpec("d0", "http://10.0.0.3:1", Role.DECODE, max_decode_seats=1)))
    async with EngineClient() as client:
        judge = Judge(t, client)
        first = t.fleet.try_reserve()
        assert first is not None
        waiting = asyncio.create_task(t.fleet.reserve())
        await asyncio.sleep(0)
        assert t.fleet.queued == 1
        t.ops.add({"id": "d9", "url": "http://10.0.0.9:1", "role": "decode"})
        await asyncio.sleep(0)
        assert not waiting.done(), "no seat on an engine not yet probed"
        await judge.readmission.tick()
        reservation = await asyncio.wait_for(waiting, 30)
        assert reservation.consumer.id == "d9"
        reservation.release()
        first.release()


async def test_a_bad_or_clashing_engine_is_refused_naming_the_key() -> None:
    t = Ops()
    error = refused(400, t.ops.add, {"id": "d9", "url": "http://10.0.0.9:1", "role": "x"})
    assert error.param == "role" and error.problems[0].startswith("role: must be one of")
    error = refused(409, t.ops.add, {"id": "d0", "url": "http://10.0.0.9:1", "role": "decode"})
    assert error.param == "id" and "already in the fleet" in error.message
    error = refused(409, t.ops.add, {"id": "d9", "url": "http://10.0.0.3:1/", "role": "decode"})
    assert error.param == "url" and "d0 already has url" in error.message
    assert t.events == []


async def test_a_patch_changes_seats_and_pin_in_place() -> None:
    t = Ops()
    reservation = t.fleet.try_reserve()
    assert reservation is not None
    consumer = reservation.consumer
    engine = t.ops.patch(consumer.id, {"max_decode_seats": 1, "pin": True})
    assert engine is consumer and engine.spec.max_decode_seats == 1 and engine.pinned
    assert engine.decode_seats == 1 and not engine.has_seat(Phase.DECODE)
    assert t.events[-1].kind == "changed"
    assert "max_decode_seats 256 -> 1, pinned True" in t.events[-1].detail
    reservation.release()
    before = len(t.events)
    t.ops.patch(consumer.id, {"pin": True})  # nothing changes, nothing is journaled
    assert len(t.events) == before


async def test_a_role_change_that_empties_a_phase_is_refused_unless_forced() -> None:
    t = Ops((SPECS[0], SPECS[2]))
    error = refused(409, t.ops.patch, "d0", {"role": "prefill"})
    assert "no admitted engine to decode" in error.message
    roles = [t.fleet.by_id["d0"].spec.role]
    t.ops.patch("d0", {"role": "both"})  # keeps decode: fine
    roles.append(t.fleet.by_id["d0"].spec.role)
    t.ops.patch("d0", {"role": "prefill"}, force=True)
    roles.append(t.fleet.by_id["d0"].spec.role)
    assert roles == [Role.DECODE, Role.BOTH, Role.PREFILL]
    assert "role both -> prefill" in t.events[-1].detail
    error = refused(400, t.ops.patch, "d0", {"url": "http://x:1"})
    assert error.param == "url"


# Breaker, readmission and placement beside drains ---------------------------------------


def failure(engine: str) -> NarwhalError:
    return engine_error(Cause.SILENCE, "quiet", engine)


async def test_the_breaker_does_not_count_a_drained_engine_nor_eject_one() -> None:
    t = Ops()
    breaker = Breaker(t.fleet, eject_after=1, max_ejected_fraction=0.5)
    t.ops.drain("d1")
    # d1 drained: d0 is the only decode member, and the last of a phase is spared.
    assert not breaker.failure(failure("d0"))
    assert t.fleet.by_id["d0"].spared
    t.ops.readmit("d1")
    t.ops.drain("d0")
    assert not breaker.failure(failure("d0")) and not t.fleet.by_id["d0"].ejected
    assert t.fleet.by_id["d0"].streak == 2


async def test_a_drained_engine_gets_no_panic_placement_and_is_named_in_the_503() -> None:
    t = Ops((SPECS[0], SPECS[2]))
    t.ops.drain("d0", force=True)
    with pytest.raises(NarwhalError) as caught:
        t.fleet.try_reserve()
    assert caught.value.status == 503 and "1 drained by an operator" in caught.value.message


async def test_readmission_never_judges_a_drained_engine_nor_pairs_with_one() -> None:
    t = Ops()
    async with EngineClient() as client:
        readmission = Readmission(t.config, t.fleet, client)
        judged: list[str] = []

        async def judge(engine: Any) -> Any:
            judged.append(engine.id)
            raise AssertionError("not judged")

        readmission.judge = judge  # type: ignore[method-assign]
        d0 = t.fleet.by_id["d0"]
        t.eject("d0")
        t.ops.drain("d0", force=True)
        assert not readmission.urgent()
        await readmission.tick()
        assert judged == [] and d0.ejected and t.state("d0") == "drained"
        t.eject("d1")
        assert readmission._partners(Phase.DECODE, t.fleet.by_id["p0"]) == [t.fleet.by_id["d1"]]


async def test_a_drained_member_leaves_its_restart_wave() -> None:
    t = Ops()
    config = Config("m", SPECS, recovery=RecoveryConfig(restart_policy=RestartPolicy.WHOLE_WAVE))
    async with EngineClient() as client:
        readmission = Readmission(config, t.fleet, client)
        for engine in ("d0", "d1"):
            t.eject(engine)
        readmission._passed(t.fleet.by_id["d1"])
        assert t.state("d1") == "held"
        t.ops.drain("d0", force=True)
        assert readmission.wave == set() and t.state("d1") == "admitted"


# Reload ---------------------------------------------------------------------------------


def fleet_file(path: Path, *engines: tuple[str, str, str], extra: str = "") -> Path:
    lines = ['model = "m"', extra]
    for engine_id, url, role in engines:
        lines += ["[[engines]]", f'id = "{engine_id}"', f'url = "{url}"', f'role = "{role}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def as_entries(*specs: EngineSpec) -> list[tuple[str, str, str]]:
    return [(s.id, s.url, s.role.value) for s in specs]


async def test_a_reload_adds_changes_and_drains_then_deletes_dropped_engines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.toml"
    t = Ops(path=path)
    busy = t.fleet.by_id["d1"]
    busy.decode_seats = 1  # a request still streams there
    entries = [*as_entries(*SPECS[:3]), ("d9", "http://10.0.0.9:1", "both")]
    entries[1] = ("p1", SPECS[1].url, "both")
    fleet_file(path, *entries, extra="[serving]\nmax_attempts = 3")
    result = t.ops.reload()
    assert result == {
        "path": str(path),
        "added": ["d9"],
        "changed": {"p1": ["role"]},
        "removing": ["d1"],
        "restart_required": ["serving"],
    }
    assert t.state("d9") == "ejected" and t.fleet.by_id["p1"].spec.role is Role.BOTH
    assert t.state("d1") == "draining" and t.fleet.by_id["d1"].remove_when_drained
    busy.decode_seats = 0
    t.fleet.seat_freed()
    assert "d1" not in t.fleet.by_id
    assert t.kinds("d1") == ["draining", "drained", "removed"]
    assert t.kinds("d9") == ["added"] and t.kinds("p1") == ["changed"]


async def test_an_engine_back_in_the_file_before_its_drain_ends_stays(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    t = Ops(path=path)
    t.fleet.by_id["d1"].decode_seats = 1
    fleet_file(path, *as_entries(*SPECS[:3]))
    t.ops.reload()
    fleet_file(path, *as_entries(*SPECS))
    assert t.ops.reload()["removing"] == []
    assert t.state("d1") == "admitted" and not t.fleet.by_id["d1"].remove_when_drained
    t.fleet.by_id["d1"].decode_seats = 0
    t.fleet.seat_freed()
    assert "d1" in t.fleet.by_id


async def test_an_already_drained_engine_dropped_by_a_reload_goes_at_once(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    t = Ops(path=path)
    t.ops.drain("d1")
    fleet_file(path, *as_entries(*SPECS[:3]))
    t.ops.reload()
    assert "d1" not in t.fleet.by_id and t.kinds("d1")[-1] == "removed"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (
            'model = "m"\n[[engines]]\nid = "p0"\nurl = "http://10.0.0.1:1"\nrole = "prefill"\n',
            "no engine may decode",
        ),
        ('model = "m"\nengines = 3\n', "engines: must be a list of tables"),
        ("model = \n", "invalid TOML"),
    ],
)
async def test_an_invalid_file_changes_nothing_and_says_why(
    tmp_path: Path, content: str, reason: str
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(content)
    t = Ops(path=path)
    error = refused(400, t.ops.reload)
    assert "the running fleet is kept" in error.message and reason in error.message
    assert any(reason in p for p in error.problems)
    assert [e.id for e in t.fleet.engines] == ["p0", "p1", "d0", "d1"] and t.events == []


async def test_a_moved_url_refuses_the_whole_reload(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    t = Ops(path=path)
    entries = [*as_entries(*SPECS), ("d9", "http://10.0.0.9:1", "decode")]
    entries[0] = ("p0", "http://10.0.0.8:1", "prefill")
    fleet_file(path, *entries)
    error = refused(400, t.ops.reload)
    assert "p0: url changed" in error.message
    assert "d9" not in t.fleet.by_id and t.events == []


async def test_a_router_without_a_file_cannot_reload() -> None:
    assert "not started from a config file" in refused(409, Ops().ops.reload).message


async def test_a_refused_sighup_reload_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("nonsense = \n")
    t = Ops(path=path)
    with caplog.at_level("INFO", logger="narwhal.operations"):
        t.ops.reload_and_log()
        fleet_file(path, *as_entries(*SPECS[:3]))
        t.ops.reload_and_log()
    assert "reload refused" in caplog.records[0].getMessage()
    assert "removing ['d1']" in caplog.records[1].getMessage()
