"""Several simulated engines in one process, for dev fleets and tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from types import TracebackType

from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.options import SimOptions


class SimFleet:
    """Starts one SimEngine per SimOptions on entry and stops them all on exit."""

    def __init__(self, options: Sequence[SimOptions]) -> None:
        self.engines = [SimEngine(engine_options) for engine_options in options]

    async def __aenter__(self) -> SimFleet:
        try:
            async with asyncio.TaskGroup() as group:
                for engine in self.engines:
                    group.create_task(engine.start())
        except BaseException:
            await self._stop_all()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._stop_all()

    def __getitem__(self, index: int) -> SimEngine:
        return self.engines[index]

    def __iter__(self) -> Iterator[SimEngine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    async def _stop_all(self) -> None:
        async with asyncio.TaskGroup() as group:
            for engine in self.engines:
                group.create_task(engine.stop())
