"""A fake engine client for the request path's rules: scripted legs, no sockets.

`FakeLegs` answers an attempt's calls (prefill, handoff check, a streamed or whole decode)
for engines by id, raising the faults a test scripts for each engine in turn; `path()`
builds the real `Attempt`, `Outcome` and `Retries` around it on a small fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from narwhal.config.root import Config, parse_config
from narwhal.engines.client import EngineClient, LegBounds
from narwhal.engines.connector import Delivery, PrefillResult
from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.engines.whole_answer import WholeAnswer, parse_whole_answer
from narwhal.fleet.breaker import Breaker
from narwhal.fleet.models import Catalog
from narwhal.fleet.table import Fleet
from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.errors import NarwhalError
from narwhal.router.abandoned import AbandonedHandoffs
from narwhal.router.attempt import Attempt
from narwhal.router.budget import RetryBudget
from narwhal.router.call import Call
from narwhal.router.outcome import Outcome
from narwhal.router.releases import Releases
from narwhal.router.retry import Retries

MODEL = "m"
DESCRIPTOR = b'{"do_remote_prefill":true,"remote_block_ids":[1],"remote_host":"127.0.0.1"}'
# A consumer's whole answer, as an engine might space it.
WHOLE = (
    b'{"id": "cmpl-x", "choices": [{"text": "hi"}],'
    b' "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
)


class FakeStream:
    """What a decode leg hands the relay: it only knows its engine and whether it closed."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.closed = False

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.closed = True


@dataclass
class FakeLegs:
    """Scripted legs: `faults[engine]` are raised by that engine's legs, one per leg, in
    order; an engine with none left answers well. `legs` records (kind, engine)."""

    faults: dict[str, list[NarwhalError]] = field(default_factory=dict)
    descriptor: bytes | None = DESCRIPTOR
    # Seconds added to a prefill's start, as if its answer had come that much later.
    age_s: float = 0.0
    legs: list[tuple[str, str]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    # What a whole decode answers, and the timeout each was sent with.
    whole: bytes = WHOLE
    whole_timeouts: list[float] = field(default_factory=list)
    # The bounds each prefill and streamed decode was sent with (None: the client's own).
    bounds: list[tuple[str, LegBounds | None]] = field(default_factory=list)
    # A whole decode's fault strikes once its request (and descriptor) went out.
    whole_faults_after_send: bool = False

    def _fault(self, engine: str) -> None:
        pending = self.faults.get(engine)
        if pending:
            raise pending.pop(0)

    async def prefill(
        self,
        producer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        same_worker: bool = False,
        request_id: str | None = None,
        engine: str | None = None,
        kv_hosts: Iterable[str] = (),
        trace: bytes = b"",
        bounds: LegBounds | None = None,
    ) -> PrefillResult:
        name = engine or producer_url
        self.legs.append(("prefill", name))
        self.bounds.append(("prefill", bounds))
        self._fault(name)
        started = asyncio.get_running_loop().time() - self.age_s
        descriptor = None if same_worker else self.descriptor
        return PrefillResult(
            producer_url, endpoint, request_id or "x", descriptor, started, 3, producer=name
        )

    async def handoff_descriptor(
        self, consumer_url: str, endpoint: str, result: PrefillResult
    ) -> bytes | None:
        return result.descriptor

    async def send_decode(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        drop_usage: bool = False,
        trace: bytes = b"",
        delivery: Delivery | None = None,
        bounds: LegBounds | None = None,
    ) -> DecodeStream:
        name = engine or consumer_url
        self.legs.append(("decode", name))
        self.bounds.append(("decode", bounds))
        self._fault(name)
        if delivery is not None:
            delivery.written = True
        stream = FakeStream(name)
        self.streams.append(stream)
        return cast(DecodeStream, stream)

    async def send_whole(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        timeout_s: float = 0.0,
        trace: bytes = b"",
        delivery: Delivery | None = None,
    ) -> WholeAnswer:
        name = engine or consumer_url
        self.legs.append(("whole", name))
        self.whole_timeouts.append(timeout_s)
        if delivery is not None and self.whole_faults_after_send:
            delivery.written = True
        self._fault(name)
        if delivery is not None:
            delivery.written = True
        return parse_whole_answer(self.whole, name)

    async def send_responses(
        self,
        consumer_url: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        rewrite: Mapping[str, Any],
        engine: str | None = None,
        trace: bytes = b"",
        delivery: Delivery | None = None,
        bounds: LegBounds | None = None,
    ) -> ResponsesStream:
        # The Responses route's legs are tested over sockets (tests/e2e/test_responses.py).
        raise NotImplementedError("the scripted legs serve the completions and chat routes")


def config(engines: Iterable[tuple[str, str]], **sections: Mapping[str, object]) -> Config:
    """A fleet file: `engines` as (id, role) pairs on unreachable ports."""
    listed = [
        {"id": engine, "url": f"http://127.0.0.1:{9 + i}", "role": role}
        for i, (engine, role) in enumerate(engines)
    ]
    return parse_config({"model": MODEL, **sections, "engines": listed})


def request(**body: object) -> ClientRequest:
    raw = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
    return parse_client_request(Endpoint.COMPLETIONS, orjson.dumps(raw), MODEL)


def call(deadline_s: float = 60.0) -> Call:
    return Call(
        request_id="r1",
        client_request_id=None,
        endpoint=Endpoint.COMPLETIONS,
        arrival=time.perf_counter(),
        deadline=asyncio.get_running_loop().time() + deadline_s,
    )


@dataclass
class Path:
    """The request path's mechanism around fake legs."""

    config: Config
    legs: FakeLegs
    fleet: Fleet
    breaker: Breaker
    outcome: Outcome
    attempt: Attempt
    retries: Retries
    abandoned: AbandonedHandoffs
    released: list[str]

    def seats_held(self) -> int:
        return sum(e.prefill_seats + e.decode_seats for e in self.fleet.engines)


def path(settings: Config, legs: FakeLegs) -> Path:
    fleet = Fleet(settings.engines, catalog=Catalog.from_config(settings))
    recovery = settings.recovery
    breaker = Breaker(fleet, recovery.eject_after, recovery.max_ejected_fraction)
    serving, continuation = settings.serving, settings.continuation
    outcome = Outcome(
        fleet,
        breaker,
        RetryBudget(serving.retry_budget, serving.retry_replenish),
        RetryBudget(continuation.budget, continuation.replenish),
        failure_quarantine_s=recovery.failure_quarantine_s,
    )
    abandoned = AbandonedHandoffs()
    released: list[str] = []

    def spawn(coroutine: Coroutine[Any, Any, None], name: str) -> None:
        # The test runs no background: a release is noted by name, never run.
        coroutine.close()
        released.append(name)

    releases = Releases(cast(EngineClient, legs), abandoned, 1.0, spawn)
    attempt = Attempt(settings, legs, fleet, outcome, abandoned, releases)
    retries = Retries(attempt, outcome)
    return Path(settings, legs, fleet, breaker, outcome, attempt, retries, abandoned, released)
