"""Two base models on real vLLM engines: one router, two pools.

A second tiny model (.cache/tiny-model-b: the same tokenizer and shapes, weights from
another seed) is served as MODEL_B by a producer and a consumer of its own, beside the
session's pair of MODEL. A router over all four, with `[[engines]] model` and a
`[[models]]` entry (one alias each) per model, places each request inside its model's pool:
each model and its alias answer what one engine of that model alone answers, the two models
answer differently, the prompt's KV is pulled by that pool's consumer only, and the journal
names a producer and a consumer of that pool.

A handoff crossed by hand between the models (prefilled by MODEL's producer, decoded on
MODEL_B's consumer with that descriptor) is what the router must never send:
CROSSED_STATUS below is what vLLM 0.32 answers then.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.vllm_fleet import VllmEngine, VllmFleet, VllmOptions
from support.real import (
    CLIENT_TIMEOUT_S,
    FIGURES,
    KV_LEASE_S,
    MODEL,
    ROOT,
    VLLM_PYTHON,
    RealStack,
    counter,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

TINY_MODEL_B = ROOT / ".cache" / "tiny-model-b"
MODEL_B = "narwhal-tiny-b"
ALIASES = {MODEL: "tiny-a", MODEL_B: "tiny-b"}
# MODEL ends this prompt with "second network.", MODEL_B with a list of corpus words.
PROMPT = "The whales sing under grey skies and"
MAX_TOKENS = 32
PULLED = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")
COMPUTED = ("vllm:prompt_tokens_by_source_total", "local_compute")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet_b(real: RealStack) -> AsyncIterator[VllmFleet]:
    """A producer and a consumer of MODEL_B, beside the session's engines (after them, so
    that the two starts do not share the CPU)."""
    if not (TINY_MODEL_B / ".built").exists():
        pytest.fail("no second tiny model: run `make tiny-model`")
    options = VllmOptions(
        python=VLLM_PYTHON,
        model=TINY_MODEL_B,
        served_model_name=MODEL_B,
        log_dir=real.fleet.options.log_dir / "models",
        kv_lease_duration_s=KV_LEASE_S,
    )
    started = time.monotonic()
    async with VllmFleet(options, [("bp0", "prefill"), ("bd0", "decode")]) as fleet:
        FIGURES["second model's engines started together"] = f"{time.monotonic() - started:.1f} s"
        for engine in [*real.fleet, *fleet]:
            FIGURES[f"{engine.name} memory (PSS) beside the second model"] = (
                f"{engine.memory_mib():.0f} MiB"
            )
        yield fleet


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(real: RealStack, fleet_b: VllmFleet) -> AsyncIterator[RouterServer]:
    """A router over all four engines, each `[[engines]]` entry naming its model."""
    config = parse_config(
        {
            "engine": {
                "first_token_timeout_s": 60.0,
                "decode_read_timeout_s": 60.0,
                "metrics_interval_s": 0,
                "kv_lease_s": KV_LEASE_S,
            },
            "serving": {"max_attempts": 2},
            "journal": {"path": str(journal_path(fleet_b))},
            "models": [{"name": name, "aliases": [alias]} for name, alias in ALIASES.items()],
            "engines": [
                {"id": e.name, "url": e.url, "role": e.role, "model": model}
                for fleet, model in ((real.fleet, MODEL), (fleet_b, MODEL_B))
                for e in fleet
            ],
        },
        source="tests/real (two models)",
    )
    server = RouterServer(config, port=0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def journal_path(fleet: VllmFleet) -> Path:
    return fleet.options.log_dir / "journal.jsonl"


def pools(real: RealStack, fleet_b: VllmFleet) -> dict[str, tuple[VllmEngine, VllmEngine]]:
    """Each model's producer and consumer."""
    return {MODEL: (real.producer, real.consumer), MODEL_B: (fleet_b["bp0"], fleet_b["bd0"])}


async def post(url: str, body: dict[str, Any], request_id: str | None = None) -> tuple[int, Any]:
    """A greedy completion of PROMPT: (status, the JSON body, or the text if not JSON)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    request = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/v1/completions", json=request, headers=headers) as response,
    ):
        raw = await response.text()
    try:
        return response.status, json.loads(raw)
    except json.JSONDecodeError:
        return response.status, raw


async def alone(engine: VllmEngine, model: str) -> str:
    """What one engine answers by itself."""
    status, body = await post(engine.url, {"model": model})
    assert status == 200, body
    return str(body["choices"][0]["text"])


async def journal_entry(fleet_b: VllmFleet, request_id: str) -> dict[str, Any]:
    """The router's journal line for this X-Request-Id (written by a thread: it may land a
    moment after the answer)."""
    for _ in range(100):
        for line in journal_path(fleet_b).read_text().splitlines():
            entry: dict[str, Any] = json.loads(line)
            if entry.get("client_request_id") == request_id:
                return entry
        await asyncio.sleep(0.1)
    raise AssertionError(f"no journal line for request {request_id}")


async def by_hand(producer: VllmEngine, consumer: VllmEngine, model: str) -> str:
    """A handoff without the router, inside one model's pool."""
    status, prefill = await post(
        producer.url,
        {"model": model, "max_tokens": 1, "kv_transfer_params": prefill_request_params()},
    )
    assert status == 200, prefill
    status, answer = await post(
        consumer.url, {"model": model, "kv_transfer_params": prefill["kv_transfer_params"]}
    )
    assert status == 200, answer
    return str(answer["choices"][0]["text"])


async def pulled(engine: VllmEngine) -> float:
    return await counter(engine, PULLED[0], source=PULLED[1])


async def test_the_two_models_answer_differently(real: RealStack, fleet_b: VllmFleet) -> None:
    by_model = {
        model: await alone(producer, model) for model, (producer, _) in pools(real, fleet_b).items()
    }
    assert all(text.strip() for text in by_model.values()), by_model
    assert by_model[MODEL] != by_model[MODEL_B]
    assert await alone(fleet_b["bd0"], MODEL_B) == by_model[MODEL_B], "both engines load it"


@pytest.mark.parametrize("model", [MODEL, MODEL_B])
@pytest.mark.parametrize("named", ["name", "alias"])
async def test_each_model_is_served_inside_its_own_pool(
    real: RealStack, fleet_b: VllmFleet, router: RouterServer, model: str, named: str
) -> None:
    by_pool = pools(real, fleet_b)
    producer, consumer = by_pool[model]
    (other_consumer,) = [c for m, (_, c) in by_pool.items() if m != model]
    expected = await alone(producer, model)
    asked = model if named == "name" else ALIASES[model]
    # A loaded machine may make the router retry (an expired handoff, a refused
    # connection), which proves nothing about a handoff: such a request is asked again.
    for _ in range(3):
        before = await pulled(consumer), await pulled(other_consumer)
        request_id = f"models-{uuid.uuid4().hex}"
        status, answer = await post(router.url, {"model": asked}, request_id)
        assert status == 200, answer
        entry = await journal_entry(fleet_b, request_id)
        if (entry["handoff"], entry["attempts"]) == ("crossed", 1):
            break
        FIGURES["two-model requests asked again"] = str(
            int(FIGURES.get("two-model requests asked again", "0")) + 1
        )
    else:
        raise AssertionError(f"no request crossed in three tries: {entry}")
    assert answer["choices"][0]["text"] == expected
    assert answer["model"] == model, "the engines get the model's name, not its alias"
    assert (entry["model"], entry["producer"], entry["consumer"]) == (
        model,
        producer.name,
        consumer.name,
    ), entry
    after = await pulled(consumer), await pulled(other_consumer)
    assert after[0] > before[0], "its pool's consumer pulled the prompt's KV"
    assert after[1] == before[1], "the other pool's consumer pulled nothing"


# What vLLM 0.32 answers a decode of MODEL's KV on MODEL_B's consumer: the NIXL handshake's
# compatibility hash covers model_config.model (nixl/metadata.py
# compute_nixl_compatibility_hash), so the consumer refuses the producer and, with
# kv_load_failure_policy "fail" (the default), ends the request with an error.
# It answers at once (0.1 to 0.3 s measured), and the prompt is neither pulled nor recomputed.
CROSSED_STATUS = 500
CROSSED_ANSWER = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


async def test_a_handoff_crossed_between_base_models_is_refused_by_the_handshake(
    real: RealStack, fleet_b: VllmFleet
) -> None:
    """Never through the router: by hand, prefilled on MODEL's producer and decoded, with
    that descriptor, on MODEL_B's consumer, naming MODEL_B."""
    producer, consumer = real.producer, fleet_b["bd0"]
    status, prefill = await post(
        producer.url,
        {"model": MODEL, "max_tokens": 1, "kv_transfer_params": prefill_request_params()},
    )
    assert status == 200, prefill
    descriptor = prefill["kv_transfer_params"]
    assert descriptor and descriptor["do_remote_prefill"] is True, prefill
    pulled_before = await pulled(consumer)
    computed_before = await counter(consumer, COMPUTED[0], source=COMPUTED[1])
    failed_before = await counter(consumer, "vllm:nixl_num_failed_transfers_total")
    started = time.monotonic()
    status, answer = await post(consumer.url, {"model": MODEL_B, "kv_transfer_params": descriptor})
    FIGURES["crossed base-model decode answered"] = (
        f"{status} after {time.monotonic() - started:.1f} s"
    )
    assert (status, answer) == (CROSSED_STATUS, CROSSED_ANSWER)
    # Refused before any block moved, and not recomputed in its place.
    assert await pulled(consumer) == pulled_before
    assert await counter(consumer, COMPUTED[0], source=COMPUTED[1]) == computed_before
    failed = await counter(consumer, "vllm:nixl_num_failed_transfers_total") - failed_before
    assert failed == 1, "a failed handshake counts as a failed transfer"
    # The producer's blocks were never pulled: wait out their lease, so that its next
    # transfers (other modules' tests) do not wait for them.
    await real.wait_out_lease()
    # The failed handshake leaves both pools' handoffs working.
    for model, (pool_producer, pool_consumer) in pools(real, fleet_b).items():
        expected = await alone(pool_producer, model)
        assert await by_hand(pool_producer, pool_consumer, model) == expected, model
