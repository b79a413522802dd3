"""The step loop: shared prefill budget, decodes credited per step, cancellation, stalls.

Assertions count steps, not seconds, so they hold on a busy machine.
"""

from __future__ import annotations

import asyncio

from narwhal.tools.sim.steps import StepLoop
from narwhal.tools.sim.timing import StepCosts

TINY = StepCosts(prefill_s_per_token=1e-6, inter_token_s=1e-4, max_num_batched_tokens=100)


async def test_queued_prompts_share_the_budget_first_come_first_served() -> None:
    steps = StepLoop(TINY)
    finished: list[tuple[str, int]] = []

    async def prefill(name: str, tokens: int) -> None:
        await steps.prefill(tokens)
        finished.append((name, steps.steps))

    await asyncio.gather(prefill("a", 150), prefill("b", 100), prefill("c", 50))
    # 300 tokens at 100 a step: a ends in step 2, b in step 3 (50 + 50), c in step 3 too.
    assert finished == [("a", 2), ("b", 3), ("c", 3)]


async def test_a_decode_makes_one_token_per_step_until_it_has_made_them_all() -> None:
    steps = StepLoop(TINY)
    decoding = steps.decode(context=10, tokens=5)
    await decoding.tokens(2)
    assert steps.steps == 2
    await decoding.tokens(10)  # only 3 are left
    assert steps.steps == 5 and steps.decoding == 0
    assert decoding.context == 15


async def test_tokens_keep_coming_while_the_request_is_busy_elsewhere() -> None:
    steps = StepLoop(TINY)
    decoding = steps.decode(context=1, tokens=50)
    await asyncio.sleep(0.05)  # the request is away; the loop keeps stepping
    before = steps.steps
    assert before >= 1
    await decoding.tokens(before)  # already made: no more steps needed
    assert decoding.ready >= 0 and steps.steps - before <= 1
    decoding.leave()


async def test_decodes_wait_while_a_prompt_runs_beside_them() -> None:
    """The step that carries prompt tokens is long for the decode in it: at 1 ms a step
    the decode would make ~200 tokens in the prompt's 0.2 s, but it makes one or two."""
    costs = StepCosts(prefill_s_per_token=0.001, inter_token_s=0.001, max_num_batched_tokens=200)
    steps = StepLoop(costs)
    decoding = steps.decode(context=1, tokens=100_000)
    await decoding.tokens(1)
    made_before = 100_000 - decoding.left
    await steps.prefill(199)  # with the decode: one step of 0.2 s
    assert 100_000 - decoding.left - made_before <= 3
    decoding.leave()


async def test_a_cancelled_prefill_leaves_the_queue() -> None:
    steps = StepLoop(StepCosts(prefill_s_per_token=0.01, max_num_batched_tokens=10))
    waiting = asyncio.create_task(steps.prefill(1000))
    await asyncio.sleep(0.02)
    waiting.cancel()
    await asyncio.sleep(0.05)
    finished = asyncio.create_task(steps.prefill(5))
    await asyncio.wait_for(finished, 5)


async def test_free_decodes_never_wait_for_a_step() -> None:
    steps = StepLoop(StepCosts())
    decoding = steps.decode(context=1, tokens=100)
    await decoding.tokens(100)
    assert steps.steps == 0 and steps.decoding == 0


async def test_close_stops_stepping() -> None:
    steps = StepLoop(TINY)
    steps.decode(context=1, tokens=10**6)
    await asyncio.sleep(0.01)
    steps.close()
    count = steps.steps
    await asyncio.sleep(0.01)
    assert steps.steps == count and steps.decoding == 0
