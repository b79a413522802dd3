"""Readmission: an ejected engine returns only after it demonstrably works again.

Every `recovery.readmit_interval_s` (every `recovery.urgent_readmit_interval_s`, and at
once on the ejection, while a phase has no admitted engine and an ejected engine serves
it), each ejected engine is judged in order:
1. `/health` answers 200 within `engine.health_timeout_s`;
2. with `[engine_contract]`, its identity is re-read and must meet the contract (an engine
   restarted with the same contract may return; one that no longer matches stays out, and
   the mismatch becomes its visible ejection reason);
3. a probe: a real tiny handoff, each leg bounded by `engine.first_token_timeout_s`. An
   engine ejected as the consumer of a crossed decode is probed with a fresh handoff from
   that same producer; otherwise the probe exercises the roles the engine serves (its own
   prefill and decode for `both`, else paired with an admitted partner, or, when no engine
   of the other phase is admitted, an ejected one: otherwise a fleet whose every engine
   was ejected could never probe its way back).

A probe that cannot be run or judged is inconclusive (neither success nor failure): the
partner it needs is not admitted, has no free seat, or the partner's own leg failed.

With `recovery.restart_policy = "whole_wave"`, engines ejected together return together.
A wave opens at an ejection when no wave is open; every engine ejected while it is open
joins it. A member that passes readmission is held (state `held`) until every member has
passed; then all re-enter placement at once and the wave closes. So that one dead member
cannot keep the fleet out of service, held members are released early whenever a phase
they serve has no admitted engine left.

An engine an operator drained is never judged, never a probe's partner and leaves any wave
it was in: only an operator's readmit ends a drain (see `operations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp

from narwhal.config.root import Config, RestartPolicy
from narwhal.engines.client import EngineClient
from narwhal.engines.identity import (
    IdentityError,
    contract_mismatches,
    handoff_mismatches,
    read_identity,
    read_served,
)
from narwhal.engines.probe import probe_transfer
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.served import learn
from narwhal.fleet.table import Engine, EngineEvent, EngineState, Fleet, Phase
from narwhal.protocol.errors import NarwhalError

log = logging.getLogger("narwhal.readmission")


@dataclass(frozen=True, slots=True)
class Verdict:
    result: str  # "success", "failure" or "inconclusive"
    detail: str


SUCCESS, FAILURE, INCONCLUSIVE = "success", "failure", "inconclusive"


class Readmission:
    """Judges ejected engines on a timer and lets back the ones that pass."""

    def __init__(self, config: Config, fleet: Fleet, client: EngineClient) -> None:
        self.config = config
        self.fleet = fleet
        self.client = client
        self.whole_wave = config.recovery.restart_policy is RestartPolicy.WHOLE_WAVE
        self.wave: set[str] = set()
        self.passed: set[str] = set()
        # Set to judge at once rather than at the next tick.
        self._wake = asyncio.Event()
        fleet.listeners.append(self._on_event)

    def _on_event(self, event: EngineEvent) -> None:
        if event.kind in ("draining", "removed"):
            self._leave_wave(event.engine)
            return
        if event.kind == "added":
            self._wake.set()  # a new engine is judged at once, not at the next tick
            return
        if event.kind != "ejected":
            return
        if self.whole_wave:
            self.wave.add(event.engine)
        if self.urgent():
            self._wake.set()

    def _leave_wave(self, engine_id: str) -> None:
        """A drained or removed engine no longer holds its wave back, nor is held by it (its
        drain made a held engine ejected again underneath: see `lifecycle`)."""
        self.wave.discard(engine_id)
        self.passed.discard(engine_id)
        if self.wave and self.passed >= self.wave:
            for member in sorted(self.wave):
                self._readmit(self.fleet.by_id[member])
            self.wave.clear()
            self.passed.clear()

    async def run(self) -> None:
        """The readmission timer; runs until cancelled."""
        recovery = self.config.recovery
        while True:
            urgent = self.urgent()
            interval = recovery.urgent_readmit_interval_s if urgent else recovery.readmit_interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.tick()

    def urgent(self) -> bool:
        """Whether a phase has no admitted engine while an ejected engine could serve it."""
        ejected = [e for e in self.fleet.engines if e.ejected and not e.draining]
        return any(
            not self.fleet.admitted(phase) and any(e.serves(phase) for e in ejected)
            for phase in Phase
        )

    async def tick(self) -> None:
        """Judge every ejected engine that is not already held, concurrently."""
        engines = [e for e in self.fleet.engines if e.ejected and not e.held and not e.draining]
        if engines:
            async with asyncio.TaskGroup() as group:
                for engine in engines:
                    group.create_task(self._judge_and_act(engine))
        self._release_held_if_needed()

    async def _judge_and_act(self, engine: Engine) -> None:
        try:
            verdict = await self.judge(engine)
        except Exception as exc:
            # A probe that breaks in an unforeseen way judges nothing; readmission goes on.
            log.exception("probe of engine %s could not run", engine.id)
            verdict = Verdict(INCONCLUSIVE, f"probe could not run: {type(exc).__name__}: {exc}")
        engine.probes[verdict.result] = engine.probes.get(verdict.result, 0) + 1
        self.fleet.emit(EngineEvent("probe", engine.id, verdict.detail, verdict.result))
        if engine.draining or engine.id not in self.fleet.by_id:
            return  # drained or removed while its probe ran: only an operator brings it back
        if verdict.result == SUCCESS:
            self._passed(engine)
        elif verdict.result == FAILURE and verdict.detail.startswith("contract"):
            engine.ejection_reason = verdict.detail
            engine.mismatched = True

    async def judge(self, engine: Engine) -> Verdict:
        timeouts = self.config.engine
        try:
            async with asyncio.timeout(timeouts.health_timeout_s):
                async with self.client.session.get(engine.url + "/health") as response:
                    engine.refusing = False
                    if response.status != 200:
                        return Verdict(FAILURE, f"/health answered HTTP {response.status}")
        except aiohttp.ClientConnectionError as exc:
            engine.refusing = True
            return Verdict(FAILURE, f"/health failed: {exc}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Verdict(FAILURE, f"/health failed: {exc or 'timed out'}")
        # What it serves now (a restarted engine may list other adapters, a new one its model).
        served = await read_served(self.client.session, engine.url, timeouts.health_timeout_s)
        if served is not None and learn(engine, served, dict(engine.adapters)):
            self.fleet.models_changed()
        contract = self.config.engine_contract
        if contract is not None:
            try:
                identity = await read_identity(
                    self.client.session, engine.spec, timeouts.health_timeout_s
                )
            except IdentityError as exc:
                return Verdict(FAILURE, f"contract: {exc}")
            mismatches = contract_mismatches(identity, contract)
            if mismatches:
                return Verdict(FAILURE, "contract mismatch: " + "; ".join(mismatches))
        return await self._probe(engine)

    async def _probe(self, engine: Engine) -> Verdict:
        pairing = self._pairing(engine)
        if isinstance(pairing, Verdict):
            return pairing
        producer, consumer = pairing
        partner = consumer if producer is engine else producer
        seated = partner is not engine
        if seated:
            phase = Phase.DECODE if partner is consumer else Phase.PREFILL
            if not partner.has_seat(phase):
                return Verdict(INCONCLUSIVE, f"partner {partner.id} has no free seat")
            _take_seat(partner, phase, +1)
        try:
            transfer = await probe_transfer(
                self.client,
                engine.model,
                producer.spec,
                consumer.spec,
                self.config.engine.first_token_timeout_s,
            )
        except NarwhalError as error:
            if error.engine != engine.id:
                return Verdict(INCONCLUSIVE, f"partner failed: {error.message}")
            return Verdict(FAILURE, f"probe failed: {error.message}")
        finally:
            if seated:
                _take_seat(partner, phase, -1)
                self.fleet.seat_freed()
        contract = self.config.engine_contract
        mismatches = handoff_mismatches(contract, transfer.descriptor) if contract else []
        if mismatches:
            return Verdict(FAILURE, "contract mismatch: " + "; ".join(mismatches))
        return Verdict(SUCCESS, f"probe {producer.id} -> {consumer.id} succeeded")

    def _pairing(self, engine: Engine) -> tuple[Engine, Engine] | Verdict:
        """(producer, consumer) for this engine's probe, or an inconclusive verdict."""
        role = engine.spec.role
        original = self.fleet.by_id.get(engine.probe_producer or "")
        if original is not None and role.can_decode:
            if original.state(_now()) is not EngineState.ADMITTED:
                return Verdict(INCONCLUSIVE, f"original producer {original.id} is not admitted")
            return original, engine
        if role.can_prefill and role.can_decode:
            return engine, engine
        if role.can_prefill:
            consumers = self._partners(Phase.DECODE, engine)
            if not consumers:
                return Verdict(INCONCLUSIVE, "no consumer to decode the probe")
            return engine, min(consumers, key=Engine.load)
        producers = self._partners(Phase.PREFILL, engine)
        if not producers:
            return Verdict(INCONCLUSIVE, "no producer to prefill the probe")
        return min(producers, key=Engine.load), engine

    def _partners(self, phase: Phase, engine: Engine) -> list[Engine]:
        """Admitted engines serving `phase`, or, when there are none, the ejected ones."""
        pool = self.fleet.pool(engine.model)
        admitted = self.fleet.admitted(phase, among=pool)
        return admitted or [
            e for e in pool if e.serves(phase) and e is not engine and not e.draining
        ]

    def _passed(self, engine: Engine) -> None:
        if not self.whole_wave or engine.id not in self.wave:
            self._readmit(engine)
            return
        self.passed.add(engine.id)
        engine.lifecycle.apply(Event.PASS, self.fleet.emit)
        if self.passed >= self.wave:
            for member in sorted(self.wave):
                self._readmit(self.fleet.by_id[member])
            self.wave.clear()
            self.passed.clear()

    def _release_held_if_needed(self) -> None:
        """Held members go back early when a phase they serve has no admitted engine."""
        held = [self.fleet.by_id[i] for i in sorted(self.passed)]
        for phase in Phase:
            if self.fleet.admitted(phase):
                continue
            for engine in held:
                if engine.serves(phase) and engine.held:
                    log.warning("releasing held engine %s: no admitted %s engine", engine.id, phase)
                    self.wave.discard(engine.id)
                    self.passed.discard(engine.id)
                    self._readmit(engine)

    def _readmit(self, engine: Engine) -> None:
        engine.streak = 0
        engine.spared = False
        engine.refusing = False
        engine.mismatched = False
        engine.probe_producer = None
        engine.lifecycle.apply(Event.READMIT, self.fleet.emit)
        self.fleet.seat_freed()


def _take_seat(engine: Engine, phase: Phase, delta: int) -> None:
    if phase is Phase.PREFILL:
        engine.prefill_seats += delta
    else:
        engine.decode_seats += delta


def _now() -> float:
    return asyncio.get_running_loop().time()
