"""A simulated engine's token loop: generate until finished, writing as the engine would,
and act out the faults that strike mid-answer (silence, a cut, a crash, an error event).

Kept apart from `sim.engine`, which owns the request's seat, prompt and lifecycle; this
module only decides when tokens are made and written, and where a fault ends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from narwhal.tools.sim.api import ApiError
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.model import Generation
from narwhal.tools.sim.outputs import Output
from narwhal.tools.sim.steps import Decoding

ZERO_INTERVAL_BATCH = 32
"""Tokens generated per transport write when there is no inter-token interval."""

KEEP_ALIVE_INTERVAL_S = 0.1
"""How often a silent stream with `silence_metadata` sends a keep-alive comment."""


async def stream_tokens(
    decoding: Decoding,
    generation: Generation,
    output: Output,
    fault: Fault,
    *,
    paced: bool,
    crash: Callable[[], None],
) -> web.StreamResponse | None:
    """Generate until finished; a fault that ends the request early returns its answer.

    `paced`: decode steps cost time, so each write carries the tokens made by then;
    `crash` drops the whole engine (the `crash_after` fault).
    """
    marks = [
        k
        for k in (fault.silence_after, fault.close_after, fault.error_after, fault.crash_after)
        if k
    ]
    while generation.finish_reason is None:
        sent = generation.completion_tokens
        if sent == 0 and fault.done_before_token and output.streaming:
            return await output.done_early()
        if fault.silence_after == sent:
            await _silence(output, fault)
        if fault.close_after == sent:
            return output.abort()
        if fault.crash_after == sent:
            crash()
            return output.abort()
        if fault.error_after == sent:
            return await output.fail(
                ApiError(fault.error_code, f"simulated fault: error after {sent} tokens")
            )
        # Up to the next fault mark: one token per write when tokens are paced, a batch
        # per write when they are not, everything at once when nobody watches the stream.
        count = min((k for k in marks if k > sent), default=generation.max_tokens) - sent
        if output.streaming:
            # Paced: the tokens already made (one, unless the stream fell behind and
            # they piled up, as vLLM's output collector merges them too).
            count = min(count, max(1, decoding.ready) if paced else ZERO_INTERVAL_BATCH)
        texts: list[str] = []
        while len(texts) < count and generation.finish_reason is None:
            texts.append(generation.step())
        await decoding.tokens(len(texts) - (sent == 0))
        await output.tokens(texts, generation)
    return None


async def _silence(output: Output, fault: Fault) -> None:
    if not fault.silence_metadata:
        await asyncio.sleep(fault.silence_s)
        return
    deadline = asyncio.get_running_loop().time() + fault.silence_s
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        await asyncio.sleep(min(KEEP_ALIVE_INTERVAL_S, left))
        await output.keep_alive()
