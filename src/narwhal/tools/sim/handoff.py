"""The engine's side of a KV handoff: the descriptor a prefill answers with, and a decode's
pull of the blocks it names (with lease heartbeats while the decode waits for a seat).

The descriptor has vLLM 0.32's members in its order (a pull-mode NixlConnector with one
KV-cache group); faults can make it malformed in the ways a broken producer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson

from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.kv import (
    Pulled,
    PullError,
    block_digests,
    pull_held,
    release_blocks,
    renew_lease_every,
)
from narwhal.tools.sim.timing import PullCosts, pull_seconds

log = logging.getLogger("narwhal.sim.handoff")


@dataclass(frozen=True, slots=True)
class Handoff:
    """One KV pull a consumer made: whose blocks, computed with what, used for what.

    `producer_adapter`/`consumer_adapter` None is the base model alone; `producer_model`
    None is a producer that did not say (an answer that never came). `ok` is False for a
    pull that failed, on a mismatched base model or anything else.
    """

    request_id: str
    remote_request_id: str | None
    producer_engine_id: str | None
    producer_model: str | None
    producer_adapter: str | None
    consumer_model: str
    consumer_adapter: str | None
    blocks: int
    ok: bool

    @property
    def crossed_model(self) -> bool:
        """The blocks came from another base model (NIXL refuses such a transfer)."""
        return self.producer_model is not None and self.producer_model != self.consumer_model

    @property
    def crossed_adapter(self) -> bool:
        """The blocks were computed with other weights over the same base model."""
        return self.ok and self.producer_adapter != self.consumer_adapter

    def to_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "remote_request_id": self.remote_request_id,
            "producer_engine_id": self.producer_engine_id,
            "producer_model": self.producer_model,
            "producer_adapter": self.producer_adapter,
            "consumer_model": self.consumer_model,
            "consumer_adapter": self.consumer_adapter,
            "blocks": self.blocks,
            "ok": self.ok,
        }


def handoff_report(handoffs: Iterable[Handoff]) -> dict[str, object]:
    """`/sim/handoffs`: the pulls an engine made, and how many crossed models or adapters."""
    kept = list(handoffs)
    return {
        "handoffs": [handoff.to_json() for handoff in kept],
        "crossed_models": sum(handoff.crossed_model for handoff in kept),
        "crossed_adapters": sum(handoff.crossed_adapter for handoff in kept),
    }


def descriptor(
    *,
    block_ids: list[int],
    engine_id: str,
    response_id: str,
    host: str,
    port: int,
    tp_size: int,
    prompt_tokens: int,
    cached_tokens: int,
    fault: Fault,
) -> dict[str, object]:
    """The `kv_transfer_params` a prefill answers with, as the fault shapes it."""
    params: dict[str, object] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        # One list per KV-cache group, as vLLM 0.32 sends them (one group here).
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": response_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        # Only a consumer's own held blocks carry an expiry time; a producer's lease
        # is renewed by heartbeats instead.
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }
    if fault.descriptor == "missing_engine_id":
        del params["remote_engine_id"]
    elif fault.descriptor == "non_integer_block_ids":
        params["remote_block_ids"] = [[str(block_id) for block_id in block_ids]]
    elif fault.descriptor == "negative_block_ids":
        params["remote_block_ids"] = [[-1 - block_id for block_id in block_ids]]
    return params


@contextlib.asynccontextmanager
async def renewing_lease(
    params: Mapping[str, object] | None, lease_s: float
) -> AsyncIterator[None]:
    """While a decode waits for a seat, keep the producer's blocks: as vLLM's consumer
    sends heartbeats every sixth of the lease until it loads the KV."""
    if params is None:
        yield
        return
    host, port = params.get("remote_host"), params.get("remote_port")
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    if not (
        isinstance(host, str)
        and type(port) is int
        and isinstance(engine_id, str)
        and isinstance(request_id, str)
    ):
        yield
        return
    heartbeat = asyncio.create_task(
        renew_lease_every(lease_s / 6, host, port, engine_id, request_id)
    )
    try:
        yield
    finally:
        heartbeat.cancel()


async def pull_prompt(
    params: Mapping[str, object],
    tokens: Sequence[int],
    response_id: str,
    *,
    fault: Fault,
    costs: PullCosts,
    block_size: int,
    model: str | None = None,
) -> Pulled:
    """Pull the prompt's blocks from the producer named by the descriptor into an engine
    serving base `model`, and check they hold this prompt (computed with whatever adapter
    the producer says); the wait is the pull's modelled cost (latency, blocks, bytes)."""
    host, port = params.get("remote_host"), params.get("remote_port")
    engine_id, block_ids = params.get("remote_engine_id"), _flat_block_ids(params)
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(engine_id, str):
        raise PullError("malformed descriptor: remote_host, remote_port, remote_engine_id")
    if block_ids is None:
        raise PullError("malformed descriptor: remote_block_ids")
    prompt_blocks = -(-len(tokens) // block_size)
    if len(block_ids) != prompt_blocks:
        raise PullError(f"{len(block_ids)} blocks offered, the prompt has {prompt_blocks}")
    request_id = params.get("remote_request_id")
    await asyncio.sleep(fault.kv_pull_delay_s + pull_seconds(costs, len(block_ids), block_size))
    if fault.kv_pull_fail:
        raise PullError("simulated fault: KV pull failed")
    pulled = await pull_held(
        host,
        port,
        engine_id,
        request_id if isinstance(request_id, str) else response_id,
        block_ids,
        model,
    )
    if pulled.digests != block_digests(tokens, block_size, pulled.adapter):
        raise PullError("pulled blocks do not match the prompt")
    return pulled


def _flat_block_ids(params: Mapping[str, object]) -> list[int] | None:
    """Block ids as one list (a descriptor may give one list per KV-cache group)."""
    block_ids = params.get("remote_block_ids")
    if isinstance(block_ids, list) and block_ids and all(isinstance(g, list) for g in block_ids):
        block_ids = [block_id for group in block_ids for block_id in group]
    if not isinstance(block_ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
    ):
        return None
    return block_ids


def rejected_handoff(raw: bytes) -> Mapping[str, object] | None:
    """The descriptor of a decode request the engine is turning away, if it carries one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return params


async def release_rejected(params: Mapping[str, object]) -> None:
    """A consumer turning a handoff away tells its producer to free the blocks, as vLLM
    0.32 does for a request rejected at its serving layer; a failure is only logged."""
    host, port = params.get("remote_host"), params.get("remote_port")
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    if not (
        isinstance(host, str)
        and isinstance(port, int)
        and isinstance(engine_id, str)
        and isinstance(request_id, str)
    ):
        return
    try:
        await release_blocks(host, port, engine_id, request_id)
    except PullError as exc:
        log.info("release of %s on %s failed: %s", request_id, engine_id, exc)
