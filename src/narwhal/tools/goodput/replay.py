"""Running the experiment: a fleet process, a router per split, the trace replayed through it.

The engines start once, in a child process, and are never told a role: a simulated engine
serves whichever leg it is sent. A split is therefore only the router's role assignment (the
first k engines prefill, the rest decode), and a fresh router per split starts with no
placement history. Prompts are random token ids salted by split, so no prefix-cache hit
carries from one split into the next. Every duration is in trace seconds: the engines run
`speed` times faster than the profile and wall-clock latencies are multiplied back.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import aiohttp
import orjson

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.goodput.idle import wait_idle
from narwhal.tools.goodput.score import Outcome, Slo
from narwhal.tools.goodput.tenants import TenantLoad
from narwhal.tools.goodput.traces import TraceRequest
from narwhal.tools.sim.model import VOCAB_SIZE

MODEL = "narwhal-sim"
IDLE_TIMEOUT_S = 30.0
"""How long a run waits for the engines to go idle before it restarts them."""
KV_LEASE_S = 600.0
"""Engines and router hold handed-off KV this long (vLLM's 30 s would expire handoffs that
an overloaded split keeps waiting, and the lease does not scale with the replay speed)."""


class FleetProcess:
    """`count` simulated engines in a child process (see narwhal.tools.goodput.fleet_proc)."""

    def __init__(self, count: int, fields: dict[str, Any]) -> None:
        self._count = count
        self._fields = fields
        self._process: asyncio.subprocess.Process | None = None
        self.urls: list[str] = []

    async def __aenter__(self) -> FleetProcess:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "narwhal.tools.goodput.fleet_proc",
            str(self._count),
            orjson.dumps(self._fields).decode(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self.urls = (await self._line())["urls"]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        assert process.stdin is not None
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()

    async def restart(self) -> None:
        """Fresh engines (new ports, empty queues and caches) in a new child process."""
        await self.__aexit__(None, None, None)
        await self.__aenter__()

    async def fair_start(self, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
        """Wait until every engine is idle, restarting them if that takes too long; says
        how long it waited and whether it restarted (for the report)."""
        started = time.monotonic()
        restarted = not await wait_idle(self.urls, timeout_s)
        if restarted:
            await self.restart()
            if not await wait_idle(self.urls, timeout_s):
                raise RuntimeError("the simulated engines are not idle even after a restart")
        return {"idle_wait_s": round(time.monotonic() - started, 2), "restarted": restarted}

    async def cpu_seconds(self) -> float:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(b"cpu\n")
        await self._process.stdin.drain()
        return float((await self._line())["cpu_s"])

    async def _line(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), 60)
        if not line:
            raise RuntimeError("the simulated fleet exited")
        value: dict[str, Any] = orjson.loads(line)
        return value


@dataclass(frozen=True, slots=True)
class SplitRun:
    prefill: int
    decode: int
    outcomes: list[Outcome]
    wall_s: float
    engine_cpu_s: float
    router_client_cpu_s: float
    # The controller run: its state at the end (moves, timeline, split).
    controller: dict[str, Any] | None = None
    # How the run started: the wait for idle engines, and whether they were restarted.
    start: dict[str, Any] | None = None
    # Wall-clock time (`time.time()`) the trace's replay began at.
    started_at: float = 0.0


def controller_sections(slo: Slo, speed: float) -> dict[str, Any]:
    """`[controller]` and `[slo]` for the controller run, in wall seconds at `speed`.

    Quick to react, since a trace phase lasts seconds to minutes: it decides every trace
    second over the last 6, keeps an engine in a role at least 4 s and waits 3 s after a
    move.
    """
    return {
        "controller": {
            "enabled": True,
            "interval_s": 1.0 / speed,
            "window_s": 6.0 / speed,
            "dwell_s": 4.0 / speed,
            "cooldown_s": 3.0 / speed,
            "min_samples": 8,
        },
        "slo": {"ttft_s": slo.ttft_s / speed, "tpot_s": slo.tpot_s / speed},
    }


def router_config(
    urls: Sequence[str],
    prefill: int,
    controller: Mapping[str, Any] | None = None,
    tenants: Sequence[TenantLoad] = (),
) -> dict[str, Any]:
    """The router for one split: the first `prefill` engines prefill, the rest decode.

    Timeouts and KV leases are long, seats unlimited and the breaker patient, so an
    overloaded split shows as latency (and missed SLOs) rather than as refusals, expired
    handoffs or ejected engines: the experiment is about capacity, not recovery.

    With `controller` (see `controller_sections`) every engine has role `both`, starts as
    that split and the role controller may move it. `tenants` are the `[[tenants]]`.
    """

    def role(i: int) -> dict[str, Any]:
        start = "prefill" if i < prefill else "decode"
        return {"role": "both", "start_as": start} if controller else {"role": start}

    return {
        **(controller or {}),
        "model": MODEL,
        "server": {"host": "127.0.0.1", "port": 0},
        "engine": {
            "first_token_timeout_s": 300.0,
            "prefill_timeout_s": 300.0,
            "decode_read_timeout_s": 0.0,
            "metrics_interval_s": 1.0,
            "kv_lease_s": KV_LEASE_S,
        },
        "recovery": {"eject_after": 1_000_000},
        "serving": {"request_timeout_s": 600.0, "queue_capacity": 100000},
        "engines": [
            {
                "id": f"e{i}",
                "url": url,
                **role(i),
                "max_prefill_seats": 0,
                "max_decode_seats": 0,
            }
            for i, url in enumerate(urls)
        ],
        **({"tenants": [tenant.tenant_table() for tenant in tenants]} if tenants else {}),
    }


async def run_split(
    fleet: FleetProcess,
    prefill: int,
    trace: Sequence[TraceRequest],
    speed: float,
    *,
    controller: Mapping[str, Any] | None = None,
    tenants: Sequence[TenantLoad] = (),
) -> SplitRun:
    """One static split, or with `controller` the role controller starting from it, on
    idle engines (see `FleetProcess.fair_start`); `tenants` configured and keyed."""
    start = await fleet.fair_start()
    raw = router_config(fleet.urls, prefill, controller, tenants)
    server = RouterServer(parse_config(raw, source="narwhal goodput"))
    await server.start()
    engine_cpu = await fleet.cpu_seconds()
    own_cpu = time.process_time()
    started, started_at = time.monotonic(), time.time()
    salt = f"{'controller' if controller else 'split'}-{prefill}"
    summary = None
    try:
        keyed = {tenant.name: tenant for tenant in tenants}
        outcomes = await replay(server.url, trace, speed, salt=salt, tenants=keyed)
        if server.router.controller is not None:
            summary = server.router.controller.summary()
    finally:
        await server.shutdown(1.0)
    return SplitRun(
        prefill=prefill,
        decode=len(fleet.urls) - prefill,
        outcomes=outcomes,
        wall_s=time.monotonic() - started,
        engine_cpu_s=await fleet.cpu_seconds() - engine_cpu,
        router_client_cpu_s=time.process_time() - own_cpu,
        controller=summary,
        start=start,
        started_at=started_at,
    )


async def replay(
    url: str,
    trace: Sequence[TraceRequest],
    speed: float,
    *,
    salt: str,
    tenants: Mapping[str, TenantLoad] | None = None,
) -> list[Outcome]:
    """Send each request at its arrival time (divided by `speed`) and time its stream.

    A request naming a tenant is sent with that tenant's key; when the tenant honours
    `Retry-After`, a refused request is sent again after it (wall seconds, as the router
    says) while the trace lasts, and each attempt is an outcome of its own."""
    tenants = tenants or {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    end_s = max((request.arrival_s for request in trace), default=0.0) / speed
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(index: int, request: TraceRequest) -> list[Outcome]:
            await asyncio.sleep(max(0.0, start + request.arrival_s / speed - loop.time()))
            tenant = tenants.get(request.tenant)
            key = tenant.key if tenant is not None else None
            outcome = await _request(session, url, request, speed, f"{salt}-{index}", key)
            attempts = [outcome]
            while (
                tenant is not None
                and tenant.retry_after
                and outcome.retry_after_s is not None
                and loop.time() - start + outcome.retry_after_s < end_s
            ):
                await asyncio.sleep(outcome.retry_after_s)
                again = replace(request, arrival_s=(loop.time() - start) * speed)
                outcome = await _request(
                    session, url, again, speed, f"{salt}-{index}", key, returned=True
                )
                attempts.append(outcome)
            return attempts

        done = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
        return [outcome for attempts in done for outcome in attempts]


async def _request(
    session: aiohttp.ClientSession,
    url: str,
    request: TraceRequest,
    speed: float,
    salt: str,
    key: str | None = None,
    *,
    returned: bool = False,
) -> Outcome:
    rng = random.Random(salt)
    body = {
        "model": MODEL,
        "prompt": [rng.randrange(VOCAB_SIZE) for _ in range(request.prompt_tokens)],
        "max_tokens": request.output_tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    failed = partial(
        Outcome,
        request.phase,
        False,
        arrival_s=request.arrival_s,
        tenant=request.tenant,
        prompt_tokens=request.prompt_tokens,
        returned=returned,
    )
    sent = time.monotonic()
    first: float | None = None
    last = sent
    tokens = 0
    tail = b""
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                return failed(
                    status=response.status,
                    retry_after_s=_retry_after(response.status, response.headers),
                )
            async for data in response.content.iter_any():
                # One `data: {...}` event per token (the usage event is off); count them
                # without parsing, across chunk boundaries.
                seen = tail + data
                if b'data: {"error"' in seen:
                    return failed()
                count = seen.count(b"data: {") - tail.count(b"data: {")
                tail = seen[-8:]
                if count:
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    tokens += count
    except (TimeoutError, aiohttp.ClientError):
        return failed(status=0)
    if first is None or tokens < request.output_tokens:
        return failed(completion_tokens=tokens)
    tpot = (last - first) * speed / (tokens - 1) if tokens > 1 else None
    return Outcome(
        request.phase,
        True,
        (first - sent) * speed,
        tpot,
        request.arrival_s,
        tenant=request.tenant,
        prompt_tokens=request.prompt_tokens,
        completion_tokens=tokens,
        returned=returned,
    )


def _retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """A refusal's `Retry-After` in seconds (429 and 503 only; None when absent)."""
    value = headers.get("Retry-After")
    if status not in (429, 503) or value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
