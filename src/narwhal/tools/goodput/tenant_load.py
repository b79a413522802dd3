"""Driving multi-tenant load at a router: each tenant's requests with its key, as it shapes them.

An open-loop tenant (`rate`) sends at its arrival times whatever the answers, as a flood
does; a closed-loop one (`concurrency`) keeps that many clients busy, each sending its next
request once it has an answer. A tenant with `retry_after` honours refusals: a 429 or 503
with `Retry-After` is sent again, the same body, once that many seconds have passed (while
the run lasts), and the return is recorded as one. A closed-loop client that does not honour
a refusal (or gets one without `Retry-After`) pauses `REFUSED_PAUSE_S` before its next
request, so that it does not spin.

Every request streams (with usage), its prompt random token ids (no prefix-cache hits, and
the router's estimate of its tokens is exact), and ends as a `tenants.Record`.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Sequence
from typing import Any, Final

import aiohttp
import orjson

from narwhal.tools.goodput.tenants import REFUSALS, Record, TenantLoad, arrival_times
from narwhal.tools.sim.model import VOCAB_SIZE

REFUSED_PAUSE_S: Final = 0.05
# Generated output in a chunk: a non-empty `text` (completions) or `content` (chat).
_GENERATED: Final = re.compile(rb'"(?:text|content)":\s*"(?!")')
_DONE: Final = b"[DONE]"
# Token ids a prompt is drawn from: past the simulator's special ids.
_FIRST_ID: Final = 16


class _Run:
    """One run's shared state: the session, the clock, and the records so far."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, model: str, t0: float, stop: float
    ) -> None:
        self.session = session
        self.url = url + "/v1/completions"
        self.model = model
        self.t0 = t0
        self.stop = stop
        self.records: list[Record] = []

    def now(self) -> float:
        """Seconds since the run's start."""
        return asyncio.get_running_loop().time() - self.t0

    async def sleep_until(self, offset: float) -> None:
        await asyncio.sleep(max(0.0, offset - self.now()))


async def drive(
    url: str,
    tenants: Sequence[TenantLoad],
    *,
    duration_s: float,
    model: str,
    seed: int = 0,
    start_at: float | None = None,
    request_timeout_s: float = 600.0,
) -> list[Record]:
    """Run every tenant's load for `duration_s` and wait for the answers; the records in
    the order they ended. `start_at` (a `time.time()` value) starts the run then, so that
    load processes each driving some tenants begin together."""
    loop = asyncio.get_running_loop()
    t0 = loop.time() + (max(0.0, start_at - time.time()) if start_at is not None else 0.0)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        run = _Run(session, url, model, t0, duration_s)
        await run.sleep_until(0.0)
        async with asyncio.TaskGroup() as group:
            for tenant in tenants:
                rng = random.Random(f"{seed}-{tenant.name}")
                if tenant.open_loop:
                    group.create_task(_open_loop(run, tenant, rng, group))
                else:
                    for _ in range(tenant.concurrency or 0):
                        group.create_task(_closed_loop(run, tenant, rng))
    return run.records


async def _open_loop(
    run: _Run, tenant: TenantLoad, rng: random.Random, group: asyncio.TaskGroup
) -> None:
    for offset in arrival_times(tenant, run.stop, rng):
        await run.sleep_until(offset)
        group.create_task(_attempts(run, tenant, _body(run, tenant, rng)))


async def _closed_loop(run: _Run, tenant: TenantLoad, rng: random.Random) -> None:
    await run.sleep_until(tenant.start_s)
    stop = min(run.stop, tenant.stop_s or run.stop)
    while run.now() < stop:
        record = await _attempts(run, tenant, _body(run, tenant, rng))
        if record.refused:
            # Refused for good: a client honouring Retry-After waits it out even when the
            # run ends first (it then sends nothing more); one that does not, pauses.
            wait = REFUSED_PAUSE_S
            if tenant.retry_after and record.retry_after_s is not None:
                wait = record.retry_after_s
            if run.now() + wait >= stop:
                return
            await asyncio.sleep(wait)


async def _attempts(run: _Run, tenant: TenantLoad, body: tuple[bytes, int, int]) -> Record:
    """Send a request, and with `retry_after` again after each refusal while the run
    lasts; the last attempt's record."""
    record = await _send(run, tenant, body, returned=False)
    while (
        tenant.retry_after
        and record.refused
        and record.retry_after_s is not None
        and run.now() + record.retry_after_s < run.stop
    ):
        await asyncio.sleep(record.retry_after_s)
        record = await _send(run, tenant, body, returned=True)
    return record


def _body(run: _Run, tenant: TenantLoad, rng: random.Random) -> tuple[bytes, int, int]:
    """A request's body, with its prompt and output token counts."""
    prompt_tokens, max_tokens = tenant.prompt_tokens or 1, tenant.max_tokens or 1
    prompt = [rng.randrange(_FIRST_ID, VOCAB_SIZE) for _ in range(prompt_tokens)]
    body = {
        "model": run.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return orjson.dumps(body), prompt_tokens, max_tokens


async def _send(
    run: _Run, tenant: TenantLoad, body: tuple[bytes, int, int], *, returned: bool
) -> Record:
    data, prompt_tokens, max_tokens = body
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {tenant.key}"}
    sent = run.now()
    fields: dict[str, Any] = {"tenant": tenant.name, "sent_s": sent, "returned": returned}
    try:
        async with run.session.post(run.url, data=data, headers=headers) as response:
            if response.status != 200:
                await response.read()
                retry = response.headers.get("Retry-After")
                record = Record(
                    **fields,
                    status=response.status,
                    ok=False,
                    retry_after_s=_seconds(retry) if response.status in REFUSALS else None,
                    ended_s=run.now(),
                )
            else:
                record = await _read_stream(run, response, fields, prompt_tokens, max_tokens)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        record = Record(**fields, status=0, ok=False, ended_s=run.now())
    run.records.append(record)
    return record


async def _read_stream(
    run: _Run,
    response: aiohttp.ClientResponse,
    fields: dict[str, Any],
    prompt_tokens: int,
    max_tokens: int,
) -> Record:
    """Count the stream's token events, time the first and last, and read its usage."""
    buffer = b""
    count = 0
    first = last = 0.0
    done = failed = False
    usage: dict[str, Any] | None = None
    async for data in response.content.iter_any():
        now = run.now()
        events = (buffer + data).split(b"\n\n")
        buffer = events.pop()
        for event in events:
            if event.endswith(_DONE):
                done = True
            elif event.startswith(b'data: {"error"'):
                failed = True
            elif _GENERATED.search(event):
                first = now if count == 0 else first
                last = now
                count += 1
            elif b'"prompt_tokens"' in event:
                usage = orjson.loads(event.removeprefix(b"data: ")).get("usage")
    sent = fields["sent_s"]
    ok = done and not failed and count == max_tokens
    return Record(
        **fields,
        status=200,
        ok=ok,
        ttft_s=first - sent if count else None,
        tpot_s=(last - first) / (count - 1) if count > 1 else None,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else prompt_tokens,
        completion_tokens=int(usage["completion_tokens"]) if usage else count,
        ended_s=run.now(),
    )


def _seconds(value: str | None) -> float | None:
    """A `Retry-After` in seconds (this router sends whole seconds), None if absent."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
