"""`priority` on a simulated engine, as on vLLM 0.32: accepted on both routes and both legs,
ignored without `--scheduling-policy priority`, and ordering the waiting queue with it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.sim.engine import SimEngine

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION = {"prompt": "The narwhal sings under the ice", "max_tokens": 4}
CHAT_BODY = {"messages": [{"role": "user", "content": "Sing"}], "max_tokens": 4}
# Holds the one seat of an engine until the client that sent it leaves.
HOLD_SEAT = {"x-sim-fault": orjson.dumps({"first_token_delay_s": 60}).decode()}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_both_routes_take_a_priority_and_the_engine_records_it(sim: Sim, policy: str) -> None:
    # vLLM 0.32 without the priority policy answers a non-zero priority as any other
    # request: 200, the priority ignored (no refusal, unlike its V0 engine).
    engine = await sim.start(scheduling_policy=policy)
    for path, body, priority in ((COMPLETIONS, COMPLETION, 5), (CHAT, CHAT_BODY, -3)):
        status, answer = await sim.post(engine, path, body | {"priority": priority})
        assert status == 200, answer
        assert engine.received[-1].priority == priority
    await sim.post(engine, COMPLETIONS, COMPLETION)
    assert engine.received[-1].priority == 0
    await sim.post(engine, COMPLETIONS, COMPLETION | {"priority": 1}, {"X-Vllm-Priority": "-2"})
    assert engine.received[-1].priority == -2


async def test_a_priority_that_is_not_an_integer_is_refused_on_both_routes(sim: Sim) -> None:
    engine = await sim.start()
    for path, body in ((COMPLETIONS, COMPLETION), (CHAT, CHAT_BODY)):
        status, answer = await sim.post(engine, path, body | {"priority": 1.5})
        assert status == 400
        assert (answer["error"]["type"], answer["error"]["param"]) == (
            "Bad Request",
            "body.priority",
        )
        assert answer["error"]["message"].startswith(
            "1 validation error:\n  {'type': 'int_from_float'"
        )


async def _served_order(sim: Sim, engine: SimEngine, priorities: list[int]) -> list[int]:
    """Hold the engine's one seat, queue one request per priority (in that order), free the
    seat: the priorities in the order their answers came back."""
    holder = asyncio.create_task(sim.stream(engine, COMPLETIONS, COMPLETION, HOLD_SEAT))
    await sim.until(lambda: engine.running_count() == 1)
    served: list[int] = []

    async def one(priority: int) -> None:
        status, _ = await sim.post(engine, COMPLETIONS, COMPLETION | {"priority": priority})
        assert status == 200
        served.append(priority)

    tasks: list[asyncio.Task[None]] = []
    for priority in priorities:
        tasks.append(asyncio.create_task(one(priority)))
        # Each in the queue before the next is sent, so that arrival order is known.
        await sim.until(lambda: engine.waiting_count() == len(tasks))
    holder.cancel()
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    return served


async def test_the_priority_policy_serves_the_lowest_priority_first(sim: Sim) -> None:
    engine = await sim.start(scheduling_policy="priority", max_num_seqs=1, faults_enabled=True)
    assert await _served_order(sim, engine, [5, 0, -5, 0]) == [-5, 0, 0, 5]


async def test_without_the_policy_the_queue_keeps_arrival_order(sim: Sim) -> None:
    engine = await sim.start(max_num_seqs=1, faults_enabled=True)
    assert await _served_order(sim, engine, [5, 0, -5]) == [5, 0, -5]


async def _handoff(
    sim: Sim, producer: SimEngine, consumer: SimEngine, path: str, body: Any
) -> None:
    leg = body | {"max_tokens": 1, "kv_transfer_params": prefill_request_params()}
    status, answer = await sim.post(producer, path, leg)
    assert status == 200, answer
    status, answer = await sim.post(
        consumer, path, body | {"kv_transfer_params": answer["kv_transfer_params"]}
    )
    assert status == 200, answer


@pytest.mark.parametrize(("path", "body"), [(COMPLETIONS, COMPLETION), (CHAT, CHAT_BODY)])
async def test_a_prefill_leg_and_a_decode_leg_both_carry_the_priority(
    sim: Sim, path: str, body: dict[str, Any]
) -> None:
    producer = await sim.start(name="p", scheduling_policy="priority")
    consumer = await sim.start(name="d", scheduling_policy="priority")
    await _handoff(sim, producer, consumer, path, body | {"priority": -4})
    assert producer.received[-1].priority == consumer.received[-1].priority == -4
    assert producer.received[-1].body["kv_transfer_params"]["do_remote_decode"] is True
    assert [h.ok for h in consumer.handoffs] == [True]
