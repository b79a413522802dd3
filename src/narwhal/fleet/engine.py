"""One engine as the router sees it: its spec, its model and adapters, its seats in use and
its standing (its `lifecycle`, which alone changes it).

Pure state and arithmetic over it; the fleet (`fleet.table`) owns the engines.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.engines.identity import ModelCard
from narwhal.engines.scrape import EngineReport
from narwhal.fleet.lifecycle import EngineState, Lifecycle
from narwhal.fleet.seat_share import WHOLE, SeatShare


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False, slots=True)
class Engine:
    """One engine as the router sees it: its spec, its seats in use and its standing (its
    `lifecycle`, which alone changes it)."""

    spec: EngineSpec
    prefill_seats: int = 0
    decode_seats: int = 0
    # Queue depth the engine itself reports (`vllm:num_requests_waiting`), when polled.
    reported_waiting: float = 0.0
    # Requests on it that other routers (or workers) sent, by its last report.
    others: float = 0.0
    # This process's part of its seat limits (see `seat_share`).
    share: SeatShare = WHOLE
    # The engine's last `/metrics` reading, and its prompt tokens by source since the first
    # (see `engine_reports`); the crossed decodes the router sent it, to compare.
    report: EngineReport | None = None
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    crossed_decodes: int = 0
    silent_recomputes: int = 0
    # Leg failures by cause (`Cause` values), since start.
    failures: dict[str, int] = field(default_factory=dict)
    # Breaker: consecutive stream failures, and why the engine was last ejected.
    streak: int = 0
    ejection_reason: str | None = None
    # After a crossed decode failure: the producer whose handoff the probe should reuse.
    probe_producer: str | None = None
    ejections: int = 0
    quarantines: int = 0
    # Its last connection attempt was refused (or broke); cleared by any answer.
    refusing: bool = False
    # Readmission found it breaks the pinned contract: never placed on, even in panic.
    mismatched: bool = False
    # The breaker would have ejected it but for `max_ejected_fraction` (this streak; times).
    spared: bool = False
    spares: int = 0
    # Requests placed on it while it was not admitted (panic placement).
    panics: int = 0
    # Readmission probes by result: "success", "failure", "inconclusive".
    probes: dict[str, int] = field(default_factory=dict)
    # Delete it once drained (a reload dropped it from the config file).
    remove_when_drained: bool = False
    # The role controller never moves it: its role is the operator's to choose.
    pinned: bool = False
    # For an engine of role `both`: the one phase it serves now (its `start_as`, or where
    # the role controller moved it); None serves both.
    acting: Role | None = None
    # Event-loop time of its last role change by the controller; None: since start.
    role_since: float | None = None
    # Where it came from: None for the config file and the admin API, "kubernetes" for
    # discovery. Placement never reads it; reloads and discovery each keep to their own.
    source: str | None = None
    # The base model it serves (its spec's, else what its `/v1/models` said, else the
    # default model): its pool.
    model: str = ""
    # The LoRA adapters it holds, least recently used first; in-flight requests per adapter;
    # and, per adapter whose load failed on it, when it may be tried again (loop time).
    adapters: dict[str, None] = field(default_factory=dict)
    adapter_users: dict[str, int] = field(default_factory=dict)
    adapter_failed: dict[str, float] = field(default_factory=dict)
    # Its last `/v1/models` listing, card by id (empty until read): what the router's own
    # listing shows of its models.
    cards: dict[str, ModelCard] = field(default_factory=dict)
    # Added at runtime: its lifecycle starts `new` (see `Fleet.add`).
    new: InitVar[bool] = False
    lifecycle: Lifecycle = field(init=False)

    def __post_init__(self, new: bool) -> None:
        self.lifecycle = Lifecycle(self.spec.id, new=new)

    @property
    def ejected(self) -> bool:
        return self.lifecycle.ejected

    @property
    def held(self) -> bool:
        return self.lifecycle.held

    @property
    def draining(self) -> bool:
        """An operator (or a source) drained it; cleared only by an undrain."""
        return self.lifecycle.draining

    @property
    def quarantined_until(self) -> float:
        return self.lifecycle.quarantined_until

    @property
    def role(self) -> Role:
        """The role placement uses: the phase it acts in, within what its spec allows."""
        return (
            self.acting
            if self.acting is not None and self.spec.role is Role.BOTH
            else self.spec.role
        )

    def holds(self, adapter: str | None) -> bool:
        """Whether it serves `adapter` now (the base weights: always)."""
        return adapter is None or adapter in self.adapters

    def use_adapter(self, adapter: str, delta: int) -> None:
        """A request on it starts (+1) or stops (-1) using `adapter`; the most recently
        used adapter goes last in the order an LRU bound evicts by."""
        users = self.adapter_users.get(adapter, 0) + delta
        if users > 0:
            self.adapter_users[adapter] = users
        else:
            self.adapter_users.pop(adapter, None)
        if delta > 0 and adapter in self.adapters:
            del self.adapters[adapter]
            self.adapters[adapter] = None

    def evictable(self) -> str | None:
        """Its least recently used adapter no request is using, if any."""
        return next((a for a in self.adapters if not self.adapter_users.get(a)), None)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    def state(self, now: float) -> EngineState:
        return self.lifecycle.state(now, self.busy())

    def serves(self, phase: Phase) -> bool:
        role = self.role
        return role.can_prefill if phase is Phase.PREFILL else role.can_decode

    def busy(self) -> bool:
        """Whether any request holds one of its seats."""
        return bool(self.prefill_seats or self.decode_seats)

    def seat_limit(self, phase: Phase) -> int | None:
        """This process's seats of the phase (its share of the engine's limit); None:
        unlimited."""
        limit = (
            self.spec.max_prefill_seats if phase is Phase.PREFILL else self.spec.max_decode_seats
        )
        return self.share.of(limit)

    def has_seat(self, phase: Phase) -> bool:
        used = self.prefill_seats if phase is Phase.PREFILL else self.decode_seats
        limit = self.seat_limit(phase)
        return limit is None or used < limit

    def load(self) -> float:
        """Fraction of this process's seats in use (a raw count where unlimited), plus the
        requests others have on the engine as a fraction of its whole capacity."""
        capacity = sum(
            limit
            for phase, limit in (
                (Phase.PREFILL, self.spec.max_prefill_seats),
                (Phase.DECODE, self.spec.max_decode_seats),
            )
            if self.serves(phase)
        )
        return (
            _fraction(self.prefill_seats, self.seat_limit(Phase.PREFILL) or 0)
            + _fraction(self.decode_seats, self.seat_limit(Phase.DECODE) or 0)
            + _fraction(self.others, capacity)
        )


def _fraction(used: float, limit: int) -> float:
    return used / limit if limit else float(used)
