"""A real, tiny handoff through two engines: the test behind readmission and preflight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from narwhal.config.engine_spec import EngineSpec
from narwhal.engines.client import EngineClient
from narwhal.engines.decode_stream import stream_payloads
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError, engine_error

PROBE_PROMPT = "Narwhal probe: is this engine serving?"
PROBE_TOKENS = 2


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a successful probe handoff showed."""

    text: str
    descriptor: dict[str, Any] | None


async def probe_transfer(
    client: EngineClient,
    model: str,
    producer: EngineSpec,
    consumer: EngineSpec,
    leg_timeout_s: float,
    *,
    require_descriptor: bool = True,
) -> Transfer:
    """Prefill on `producer`, decode on `consumer`, each leg within `leg_timeout_s`.

    Raises `NarwhalError` naming the engine whose leg failed. A crossed probe whose
    producer sends no descriptor fails when `require_descriptor` is set: a handoff that
    always recomputes is not a working transfer.
    """
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0}
    same_worker = producer.id == consumer.id
    try:
        async with asyncio.timeout(leg_timeout_s):
            result = await client.prefill(
                producer.url,
                Endpoint.COMPLETIONS,
                body,
                same_worker=same_worker,
                engine=producer.id,
                kv_hosts=producer.kv_hosts,
            )
    except TimeoutError:
        raise _slow(producer, "prefill", leg_timeout_s) from None
    descriptor = result.parameters()
    if require_descriptor and not same_worker and descriptor is None:
        raise engine_error(
            Cause.DESCRIPTOR,
            f"engine {producer.id} answered the prefill without a descriptor",
            producer.id,
        )
    pieces: list[str] = []
    try:
        async with asyncio.timeout(leg_timeout_s):
            stream = await client.open_decode(
                consumer.url,
                Endpoint.COMPLETIONS,
                body,
                result,
                engine=consumer.id,
                drop_usage=True,
            )
            async with stream:
                async for payload in stream_payloads(stream):
                    for choice in payload.get("choices") or ():
                        pieces.append(str(choice.get("text") or ""))
    except TimeoutError:
        raise _slow(consumer, "decode", leg_timeout_s) from None
    return Transfer("".join(pieces), descriptor if isinstance(descriptor, dict) else None)


def _slow(engine: EngineSpec, leg: str, seconds: float) -> NarwhalError:
    cause = Cause.PREFILL_TIMEOUT if leg == "prefill" else Cause.FIRST_TOKEN_TIMEOUT
    return engine_error(
        cause, f"probe {leg} on engine {engine.id} took over {seconds:g} s", engine.id
    )
