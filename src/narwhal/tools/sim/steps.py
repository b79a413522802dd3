"""An engine's step loop: one timer per step for all its requests, not one per token each.

Requests hand the loop their work (prompt tokens to compute, then tokens to generate) and
wait on futures; the loop plans each step with `timing.plan_step`, sleeps the step's
computed length once, then credits every participant. CPU therefore grows with steps
and with the tokens actually written, never with per-request timers.
"""

from __future__ import annotations

import asyncio

from narwhal.tools.sim.timing import StepCosts, plan_step, step_seconds

MAX_CATCH_UP_S = 0.05
"""How late a step may start and still end when planned: steps keep to a timeline, so the
event loop's own latency does not add to every step, but a long stall is not made up."""


class _PromptWork:
    """A prompt still being computed, chunk by chunk."""

    __slots__ = ("done", "left")

    def __init__(self, tokens: int, done: asyncio.Future[None]) -> None:
        self.left = tokens
        self.done = done


class Decoding:
    """One sequence in the decode batch: the loop makes its tokens, the request takes them.

    Tokens are made whether or not the request is waiting for them, as an engine keeps
    generating while a client reads slowly; the sequence leaves the batch when it has made
    all it may, or when the request ends (`leave`).
    """

    __slots__ = ("_loop", "_waiter", "_want", "context", "left", "ready")

    def __init__(self, loop: StepLoop | None, context: int, tokens: int) -> None:
        self._loop = loop
        self.context = context
        self.left = tokens
        self.ready = 0
        self._want = 0
        self._waiter: asyncio.Future[None] | None = None

    async def tokens(self, count: int) -> None:
        """Wait until `count` more tokens are made (fewer if the sequence runs out)."""
        if self._loop is None:
            # Free decode steps: let other streams run, as one step would.
            await asyncio.sleep(0)
            return
        count = min(count, self.ready + self.left)
        if count <= 0 or self.ready >= count:
            self.ready -= max(count, 0)
            await asyncio.sleep(0)
            return
        self._want = count
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        self.ready -= count

    def leave(self) -> None:
        if self._loop is not None:
            self._loop.leave(self)

    def made_one(self) -> bool:
        """The loop made a token; True when the sequence has no more to make."""
        self.left -= 1
        self.ready += 1
        self.context += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self.ready >= self._want:
            waiter.set_result(None)
        return self.left <= 0


class StepLoop:
    """Runs an engine's steps while it has work; idle, it costs nothing."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self._prompts: dict[_PromptWork, None] = {}
        self._decoding: dict[Decoding, None] = {}
        self._task: asyncio.Task[None] | None = None
        self._due: float | None = None  # when the running (or last) step ends; None: idle
        self.steps = 0

    async def prefill(self, tokens: int) -> None:
        """Compute `tokens` prompt tokens in the steps' shared budget (the step that ends
        the prompt also makes its first token)."""
        if tokens <= 0:
            await asyncio.sleep(0)
            return
        work = _PromptWork(tokens, asyncio.get_running_loop().create_future())
        self._prompts[work] = None
        self._wake()
        try:
            await work.done
        finally:
            self._prompts.pop(work, None)

    def decode(self, context: int, tokens: int) -> Decoding:
        """Join the decode batch to make `tokens` tokens after `context` tokens of KV."""
        if self.costs.decode_is_free:
            return Decoding(None, context, tokens)
        decoding = Decoding(self, context, tokens)
        if tokens > 0:
            self._decoding[decoding] = None
            self._wake()
        return decoding

    def leave(self, decoding: Decoding) -> None:
        self._decoding.pop(decoding, None)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    def close(self) -> None:
        """The engine died: stop stepping (its requests are cancelled by their owners)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._prompts.clear()
        self._decoding.clear()

    def _wake(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        self._due = None
        try:
            while self._prompts or self._decoding:
                await self._step()
        finally:
            self._task = None

    async def _step(self) -> None:
        prompts = list(self._prompts)
        decodes = list(self._decoding)
        plan = plan_step(
            [work.left for work in prompts],
            [decoding.context for decoding in decodes],
            self.costs.max_num_batched_tokens,
        )
        seconds = step_seconds(self.costs, plan)
        now = asyncio.get_running_loop().time()
        start = now if self._due is None else max(self._due, now - MAX_CATCH_UP_S)
        self._due = start + seconds
        await asyncio.sleep(max(0.0, self._due - now))
        self.steps += 1
        for work, chunk in zip(prompts, plan.chunks, strict=True):
            if work not in self._prompts or not chunk:
                continue
            work.left -= chunk
            if work.left <= 0:
                del self._prompts[work]
                if not work.done.done():
                    work.done.set_result(None)
        for decoding in decodes:
            if decoding in self._decoding and decoding.made_one():
                del self._decoding[decoding]
