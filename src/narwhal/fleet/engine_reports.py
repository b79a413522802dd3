"""Reading every engine's own `/metrics` on a timer: its load, and proof of KV use.

The router counts the crossed handoffs it sends each consumer; the consumer counts where
its prompt tokens came from (`engines.scrape`). Side by side they show whether handoffs
really moved KV: a consumer that received crossed decodes while its `external_kv_transfer`
count stood still and its `local_compute` count moved recomputed the prompts silently
(a misconfigured connector, a side channel it cannot reach under `kv_load_failure_policy =
"recompute"`). Each such reading is a `silent_recompute` engine event and is counted.

A reading is judged one interval late: the decodes counted are those sent before the
previous reading, and the tokens those moved until this one, so that a decode sent just
before a reading, whose tokens the engine has not counted yet, is never taken for silence.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from narwhal.engines.http import Fetch
from narwhal.engines.scrape import EXTERNAL, LOCAL_COMPUTE, EngineReport, moved, parse_report
from narwhal.fleet.seat_share import others_load
from narwhal.fleet.table import Engine, EngineEvent, Fleet


@dataclass(frozen=True, slots=True)
class Window:
    """The last two readings of one consumer: the router's count of crossed decodes sent to
    it and the engine's own report, at each."""

    decodes_before: int
    report_before: EngineReport
    decodes_last: int
    report_last: EngineReport

    def sent(self) -> int:
        """Crossed decodes sent between the two readings."""
        return self.decodes_last - self.decodes_before


def judge_silence(
    window: Window, decodes_now: int, report_now: EngineReport
) -> tuple[bool, Window]:
    """At a new reading: whether the decodes sent between the last two readings moved no
    KV up to now while the engine computed prompt tokens itself; and the next window."""
    external = moved(window.report_before, report_now, EXTERNAL)
    computed = moved(window.report_before, report_now, LOCAL_COMPUTE)
    silent = report_now.counts_sources and window.sent() > 0 and external == 0 and computed > 0
    return silent, Window(window.decodes_last, window.report_last, decodes_now, report_now)


class EngineReports:
    """Polls each engine's `/metrics` every `interval_s`; runs until cancelled."""

    def __init__(self, fleet: Fleet, fetch: Fetch, interval_s: float, timeout_s: float) -> None:
        self.fleet = fleet
        self.fetch = fetch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._windows: dict[str, Window] = {}

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.interval_s)

    async def poll_all(self) -> None:
        # An engine removed at runtime leaves no window behind for one re-added under its id.
        for gone in self._windows.keys() - self.fleet.by_id.keys():
            del self._windows[gone]
        await asyncio.gather(*(self.poll(engine) for engine in self.fleet.engines))

    async def poll(self, engine: Engine) -> None:
        """One reading of one engine; an engine that cannot be read keeps its last one."""
        body = await self.fetch(engine.url + "/metrics", self.timeout_s)
        if body is not None:
            self.record(engine, parse_report(body))

    def record(self, engine: Engine, report: EngineReport) -> None:
        """Take a reading: the engine's load and token counts, and the silence judgment."""
        previous = engine.report
        engine.report = report
        engine.reported_waiting = report.waiting or 0.0
        engine.others = others_load(
            report.running, report.waiting, engine.prefill_seats + engine.decode_seats
        )
        if previous is not None:
            for source in report.prompt_tokens:
                engine.prompt_tokens[source] = engine.prompt_tokens.get(source, 0.0) + moved(
                    previous, report, source
                )
        window = self._windows.get(engine.id)
        decodes = engine.crossed_decodes
        if window is None:
            self._windows[engine.id] = Window(decodes, report, decodes, report)
            return
        silent, self._windows[engine.id] = judge_silence(window, decodes, report)
        if silent:
            engine.silent_recomputes += 1
            self.fleet.emit(
                EngineEvent(
                    "silent_recompute",
                    engine.id,
                    f"{window.sent()} crossed decodes moved no "
                    "KV (vllm:prompt_tokens_by_source external_kv_transfer did not move) "
                    "while the engine computed prompt tokens itself",
                )
            )
