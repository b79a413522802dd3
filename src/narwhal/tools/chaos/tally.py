"""Counting a soak's outcomes and problems as they come, without keeping the requests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from narwhal.tools.chaos.checks import (
    CLIENT_CLOSED,
    AbandonedTotals,
    add_journal_abandoned,
    cut_excuse,
    cut_outcome,
    line_problems,
    moved_to,
    no_engine_problems,
    role_problems,
    text_problems,
    unavailable_reason,
    view_problems,
)
from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.chaos.load import Sent

SHOWN_PROBLEMS = 5


@dataclass(slots=True)
class Problems:
    """How many problems a check found, and the first few of them."""

    count: int = 0
    shown: list[str] = field(default_factory=list)

    def add(self, problems: Iterable[str]) -> None:
        for problem in problems:
            self.count += 1
            if len(self.shown) < SHOWN_PROBLEMS:
                self.shown.append(problem)


class Tally:
    """Judges each request once both its client's view and its journal line are in, then
    keeps only counts: a long run's memory does not grow with its number of requests."""

    def __init__(
        self,
        seed: int,
        max_attempts: int,
        downtime: Downtime | None = None,
        pinned: frozenset[str] = frozenset(),
        floor: int = 1,
    ) -> None:
        """`downtime` is read as lines come in: every outage a line's request lived
        through began before the line was written. `pinned` engines must never move, and
        no move may leave a phase with fewer than `floor` engines."""
        self._prefix = f"chaos-{seed}-"
        self._max_attempts = max_attempts
        self._downtime = Downtime({}) if downtime is None else downtime
        self._sent: dict[int, Sent] = {}
        self._lines: dict[int, dict[str, Any]] = {}
        self._judged = bytearray()
        self.requests = self.lines = self.left = self.closed = self.terminal = 0
        # Journal lines whose request took more than one attempt: faults the router survived.
        self.retried = 0
        self.outcomes: Counter[tuple[int, str]] = Counter()
        # 429 and 503 answers by (status, reason).
        self.unavailable: Counter[tuple[int, str]] = Counter()
        self.once = Problems()
        self.rules = Problems()
        self.views = Problems()
        self.no_engine = Problems()
        self.texts = Problems()
        # Answers whose consumer failed after output began, by `cut_outcome`: continued
        # (ended complete), excused (could not have been continued), failed.
        self.cut: Counter[str] = Counter()
        # The excused ones by `cut_excuse`.
        self.cut_excuses: Counter[str] = Counter()
        # Abandoned handoffs per producer, summed over the journal's lines.
        self.abandoned: dict[str, AbandonedTotals] = {}
        # Role controller moves, and pins or floors they broke.
        self.moves = 0
        self.roles = Problems()
        self._pinned, self._floor = pinned, floor

    def id_of(self, sent: Sent) -> str:
        return f"{self._prefix}{sent.index}"

    def add_sent(self, sent: Sent) -> None:
        self.requests += 1
        self.left += sent.left
        self.terminal += sent.terminal is not None
        if sent.hung:
            self.once.add([f"{self.id_of(sent)}: no answer within the client's patience"])
        if sent.broken is not None and not sent.left:
            self.once.add([f"{self.id_of(sent)}: the connection failed: {sent.broken}"])
        line = self._lines.pop(sent.index, None)
        if line is None:
            self._sent[sent.index] = sent
        else:
            self._judge(sent, line)

    def add_line(self, line: dict[str, Any]) -> None:
        self.lines += 1
        self.outcomes[line["status"], line["cause"] or line["outcome"]] += 1
        self.closed += line["status"] == CLIENT_CLOSED
        self.retried += line["attempts"] > 1
        self.rules.add(line_problems(line, self._max_attempts))
        cut = cut_outcome(line)
        if cut is not None:
            self.cut[cut] += 1
            if cut == "excused":
                self.cut_excuses[cut_excuse(line) or ""] += 1
        add_journal_abandoned(line, self.abandoned)
        reason = unavailable_reason(line)
        if reason is not None:
            self.unavailable[line["status"], reason] += 1
            self.no_engine.add(no_engine_problems(line, self._downtime))
        rid = line["client_request_id"]
        index = self._index_of(rid)
        if index is None:
            self.once.add([f"{rid}: journaled but never sent"])
        elif self._was_judged(index) or index in self._lines:
            self.once.add([f"{rid}: journaled twice"])
        elif index in self._sent:
            self._judge(self._sent.pop(index), line)
        else:
            self._lines[index] = line

    def add_engine_line(self, line: dict[str, Any]) -> None:
        """An engine event: a `role_change` changes which engines serve each phase."""
        to = moved_to(line)
        if to is None:
            return
        self.moves += 1
        engine, at = str(line["engine"]), float(line["ts"])
        self._downtime.moved(engine, to, at)
        serving = {
            phase: len(self._downtime.serving_at(phase, at)) for phase in ("prefill", "decode")
        }
        self.roles.add(role_problems(engine, to, self._pinned, serving, self._floor))

    def finish(self) -> None:
        """Once every line is in: requests left without one, lines left without a request."""
        self.once.add(f"{self.id_of(s)}: no journal line" for s in self._sent.values())
        self.once.add(f"{line['client_request_id']}: never sent" for line in self._lines.values())

    def _index_of(self, rid: object) -> int | None:
        if not isinstance(rid, str) or not rid.startswith(self._prefix):
            return None
        digits = rid.removeprefix(self._prefix)
        return int(digits) if digits.isdigit() else None

    def _was_judged(self, index: int) -> bool:
        return index < len(self._judged) and self._judged[index] == 1

    def _judge(self, sent: Sent, line: Mapping[str, Any]) -> None:
        if len(self._judged) <= sent.index:
            self._judged.extend(bytes(sent.index + 1 - len(self._judged)))
        self._judged[sent.index] = 1
        if not sent.hung:
            self.views.add(view_problems(sent, line))
        self.texts.add(text_problems(sent, self.id_of(sent)))
