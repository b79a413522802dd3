"""A LoRA adapter on real vLLM engines, handed over from prefill to decode.

The tiny model's builder also writes a rank-8 adapter on q_proj and v_proj
(.cache/tiny-model/lora) whose greedy answers are other sentences of the corpus. A producer
and a consumer of their own serve it from their start (`--enable-lora --lora-modules`) and
accept runtime loads (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): on a 2-core machine
`--enable-lora` made base decoding about a third slower, so the session's engines start
without it. A handoff by hand (the adapter's prefill on one, its decode on the other)
answers what one engine alone answers with the adapter, with the prompt's KV pulled rather
than computed; a decode that names another model than its prefill still answers 200, with a
third text, which is why the router must never cross them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.vllm_fleet import LoraModule, LoraOptions, VllmEngine, VllmFleet, VllmOptions
from support.real import (
    CLIENT_TIMEOUT_S,
    FIGURES,
    KV_LEASE_S,
    MODEL,
    TINY_MODEL,
    VLLM_PYTHON,
    RealStack,
    counter,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADAPTER = LoraModule("narwhal-tiny-sea", TINY_MODEL / "lora")
# The base model ends this prompt with "second network.", the adapter with a sentence about
# the narwhal under the ice: short answers, unlike one another.
PROMPT = "The whales sing under grey skies and"
MAX_TOKENS = 32
PULLED = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")
COMPUTED = ("vllm:prompt_tokens_by_source_total", "local_compute")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_fleet(real: RealStack) -> AsyncIterator[VllmFleet]:
    """A producer and a consumer with the adapter, beside the session's engines (after
    them, so that the two starts do not share the CPU)."""
    if not (ADAPTER.path / "adapter_config.json").exists():
        pytest.fail("no tiny LoRA adapter: run `make tiny-model`")
    options = VllmOptions(
        python=VLLM_PYTHON,
        model=TINY_MODEL,
        served_model_name=MODEL,
        log_dir=real.fleet.options.log_dir / "lora",
        kv_lease_duration_s=KV_LEASE_S,
        lora=LoraOptions(modules=(ADAPTER,), runtime_updating=True),
    )
    started = time.monotonic()
    async with VllmFleet(options, [("lp0", "prefill"), ("ld0", "decode")]) as fleet:
        FIGURES["LoRA engines started together"] = f"{time.monotonic() - started:.1f} s"
        for engine in [*real.fleet, *fleet]:
            FIGURES[f"{engine.name} memory (PSS) beside the LoRA pair"] = (
                f"{engine.memory_mib():.0f} MiB"
            )
        yield fleet


async def completion(
    engine: VllmEngine, model: str, max_tokens: int = MAX_TOKENS, **extra: Any
) -> tuple[int, dict[str, Any]]:
    """A greedy completion of PROMPT straight to one engine: (status, body)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(engine.url + "/v1/completions", json={**body, **extra}) as response,
    ):
        return response.status, await response.json()


async def text(engine: VllmEngine, model: str) -> str:
    status, body = await completion(engine, model)
    assert status == 200, body
    return str(body["choices"][0]["text"])


async def by_hand(producer: VllmEngine, consumer: VllmEngine, prefill: str, decode: str) -> str:
    """A handoff without the router: `prefill` names the producer's model, `decode` the
    consumer's, and the consumer pulls the blocks the descriptor names."""
    status, answer = await completion(
        producer, prefill, max_tokens=1, kv_transfer_params=prefill_request_params()
    )
    assert status == 200, answer
    descriptor = answer["kv_transfer_params"]
    assert descriptor and descriptor["do_remote_prefill"] is True, answer
    status, answer = await completion(consumer, decode, kv_transfer_params=descriptor)
    assert status == 200, answer
    assert answer["model"] == decode
    return str(answer["choices"][0]["text"])


async def test_the_adapter_is_listed_under_its_base_and_answers_other_text(
    lora_fleet: VllmFleet,
) -> None:
    producer = lora_fleet["lp0"]
    async with aiohttp.ClientSession() as http, http.get(producer.url + "/v1/models") as response:
        models = {card["id"]: card for card in (await response.json())["data"]}
    assert models[MODEL]["parent"] is None
    card = models[ADAPTER.name]
    assert (card["parent"], card["root"], card["object"]) == (MODEL, str(ADAPTER.path), "model")
    base, adapted = await text(producer, MODEL), await text(producer, ADAPTER.name)
    assert base.strip() and adapted.strip()
    assert adapted != base
    assert await text(lora_fleet["ld0"], ADAPTER.name) == adapted, "both engines load it alike"


async def test_the_adapters_handoff_answers_what_one_engine_alone_does_from_pulled_kv(
    lora_fleet: VllmFleet,
) -> None:
    producer, consumer = lora_fleet["lp0"], lora_fleet["ld0"]
    alone = await text(producer, ADAPTER.name)
    pulled, computed = (
        await counter(consumer, PULLED[0], source=PULLED[1]),
        await counter(consumer, COMPUTED[0], source=COMPUTED[1]),
    )
    assert await by_hand(producer, consumer, ADAPTER.name, ADAPTER.name) == alone
    assert alone != await text(producer, MODEL)
    pulled = await counter(consumer, PULLED[0], source=PULLED[1]) - pulled
    computed = await counter(consumer, COMPUTED[0], source=COMPUTED[1]) - computed
    assert pulled > 0 and pulled / (pulled + computed) > 0.5, (pulled, computed)


async def test_a_decode_naming_another_model_than_its_prefill_answers_a_third_text(
    lora_fleet: VllmFleet,
) -> None:
    """The base model's KV decoded with the adapter: vLLM checks nothing and answers 200."""
    producer, consumer = lora_fleet["lp0"], lora_fleet["ld0"]
    base, adapted = await text(producer, MODEL), await text(producer, ADAPTER.name)
    crossed = await by_hand(producer, consumer, MODEL, ADAPTER.name)
    assert crossed not in (base, adapted)


async def test_runtime_loading_answers_as_vllm_0_32_does(lora_fleet: VllmFleet) -> None:
    consumer = lora_fleet["ld0"]
    name = f"sea-{uuid.uuid4().hex[:8]}"
    load = {"lora_name": name, "lora_path": str(ADAPTER.path)}
    async with aiohttp.ClientSession() as http:

        async def post(route: str, body: dict[str, str]) -> tuple[int, str]:
            async with http.post(consumer.url + route, json=body) as response:
                return response.status, await response.text()

        assert await post("/v1/load_lora_adapter", load) == (
            200,
            f"Success: LoRA adapter '{name}' added successfully.",
        )
        status, again = await post("/v1/load_lora_adapter", load)
        assert status == 400 and "has already been loaded" in again
        status, missing = await post(
            "/v1/load_lora_adapter", {"lora_name": f"{name}-x", "lora_path": "/no/such/adapter"}
        )
        assert status == 404 and "NotFoundError" in missing
        assert await text(consumer, name) == await text(consumer, ADAPTER.name)
        assert await post("/v1/unload_lora_adapter", {"lora_name": name}) == (
            200,
            f"Success: LoRA adapter '{name}' removed successfully.",
        )
        status, unknown = await post("/v1/unload_lora_adapter", {"lora_name": name})
        assert status == 404 and "cannot be found" in unknown
    status, _ = await completion(consumer, name)
    assert status == 404, "an unloaded adapter is an unknown model"


async def test_the_adapters_answer_through_the_router_equals_one_engine_alone(
    lora_fleet: VllmFleet, real: RealStack
) -> None:
    """The router's side: a request naming the adapter is prefilled and decoded with it."""
    journal = real.fleet.options.log_dir / "lora" / "journal.jsonl"
    config = parse_config(
        {
            "model": MODEL,
            "engine": {
                "first_token_timeout_s": 60.0,
                "decode_read_timeout_s": 60.0,
                "metrics_interval_s": 0,
                "kv_lease_s": KV_LEASE_S,
            },
            "serving": {"max_attempts": 2},
            "journal": {"path": str(journal)},
            "lora": {
                "load_on_demand": False,
                "max_adapters_per_engine": 2,
                "adapters": [{"name": ADAPTER.name, "path": str(ADAPTER.path), "base": MODEL}],
            },
            "engines": [
                {"id": e.name, "url": e.url, "role": e.role, "model": MODEL} for e in lora_fleet
            ],
        },
        source="tests/real (LoRA)",
    )
    alone = await text(lora_fleet["lp0"], ADAPTER.name)
    consumer = lora_fleet["ld0"]
    pulled = await counter(consumer, PULLED[0], source=PULLED[1])
    server = RouterServer(config, port=0)
    await server.start()
    try:
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        body = {"model": ADAPTER.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.post(server.url + "/v1/completions", json={**body, "temperature": 0}) as response,
        ):
            answer = await response.json()
            assert response.status == 200, answer
    finally:
        await server.stop()
    assert answer["choices"][0]["text"] == alone
    assert answer["model"] == ADAPTER.name
    assert await counter(consumer, PULLED[0], source=PULLED[1]) > pulled, "it crossed"
