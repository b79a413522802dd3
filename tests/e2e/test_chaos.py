"""The chaos soak, short: under random engine faults, crashes and client departures the router
keeps every promise the soak checks; and the rules the soak found missing."""

from __future__ import annotations

from narwhal.protocol.errors import Cause, engine_error
from support import COMPLETION, StackFactory, engine_state

QUICK = {"eject_after": 1, "readmit_interval_s": 0.1}


async def test_a_fleet_with_every_engine_ejected_is_readmitted_once_its_engines_work(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery=QUICK) as stack:
        router = stack.server.router
        for engine in ("p0", "d0"):
            router.breaker.failure(engine_error(Cause.CONNECT, "unreachable", engine))
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 503
        for engine in ("p0", "d0"):
            assert (await engine_state(stack, engine, "admitted"))["state"] == "admitted"
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
