"""The request path, top to bottom: admit → place → attempts → relay → outcome.

`RequestPath.handle` owns one client request: its deadline, its seats and its engine
connections end with it on every path, and it records exactly one outcome, which every
`CallHook` hears once. The tries and their retry rules are `router.retry`'s, one attempt
is `router.attempt`'s, a continued answer is `router.rescue`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from narwhal.config.root import Config, NonstreamDecode
from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.engines.whole_answer import WholeAnswer
from narwhal.fleet.models import Target
from narwhal.fleet.table import Fleet
from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.protocol.ids import new_id
from narwhal.protocol.tracecontext import passthrough
from narwhal.router.call import CLIENT_CLOSED, Call, CallHook, CallTrace
from narwhal.router.continuation import ANSWER, OFF, not_continued, tracker
from narwhal.router.outcome import Outcome
from narwhal.router.reply import Reply
from narwhal.router.rescue import Rescue
from narwhal.router.respond import answer_error, collect, forward, relay
from narwhal.router.responses import Conversations, answer_whole, relay_events
from narwhal.router.responses_rescue import ResponsesRescue, ineligible
from narwhal.router.retry import FirstTries, Retries
from narwhal.runtime.clock import clock

if TYPE_CHECKING:
    from narwhal.router.admission import Admission


class Tracer(Protocol):
    """Starts a request's spans (`observe.tracing`, when tracing is on)."""

    def begin(self, call: Call, traceparent: str | None, tracestate: str | None) -> CallTrace: ...


def shutting_down() -> NarwhalError:
    return NarwhalError(
        503, "the router is shutting down; retry shortly", Cause.UNAVAILABLE, retry_after=1
    )


def shut_down() -> NarwhalError:
    return NarwhalError(
        503, "the router shut down before this request finished", Cause.UNAVAILABLE, retry_after=1
    )


class RequestPath:
    """Every client request, from its arrival to its one recorded outcome."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        retries: Retries,
        outcome: Outcome,
        *,
        tracer: Tracer | None = None,
        admission: Admission | None = None,
        conversations: Conversations | None = None,
        call_hooks: list[CallHook],
        first_token_hooks: list[CallHook],
        arrival_hooks: list[Callable[[Call], None]],
    ) -> None:
        """`call_hooks` hear each request once it ended (the journal first),
        `first_token_hooks` as its first token goes out to its client, `arrival_hooks` as
        it arrives, before anything can fail; `admission`: tenants' limits and claims, when
        `[[tenants]]` are configured; `conversations`: the Responses route's store."""
        self.config = config
        self.fleet = fleet
        self.retries = retries
        self.outcome = outcome
        self.tracer = tracer
        self.admission = admission
        self.conversations = conversations
        self.call_hooks = call_hooks
        self.first_token_hooks = first_token_hooks
        self.arrival_hooks = arrival_hooks
        # Non-streaming requests' decodes asked for whole, their answers forwarded.
        self.whole = config.engine.nonstream_decode is NonstreamDecode.WHOLE
        self.in_flight = 0
        self.draining = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shutdown_cancelled: set[asyncio.Task[Any]] = set()

    async def handle(self, reply: Reply, endpoint: Endpoint) -> None:
        """Serve one client request and record its one outcome, on every path."""
        call = self._admit(reply, endpoint)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                if self.draining:
                    raise shutting_down()
                async with clock().timeout_at(call.deadline):
                    await self._serve(reply, call)
            except TimeoutError:
                raise NarwhalError(
                    504,
                    "request exceeded its deadline of "
                    f"{self.config.serving.request_timeout_s:g} s (serving.request_timeout_s) "
                    f"while {call.stage.value}",
                    Cause.DEADLINE,
                ) from None
            except ConnectionResetError:
                call.status, call.error = CLIENT_CLOSED, "client closed the connection"
        except NarwhalError as error:
            call.refusal = error.refusal
            call.fail(error)
            await answer_error(reply, call, error)
        except asyncio.CancelledError:
            if not self._shut_out(task):
                call.status, call.error = CLIENT_CLOSED, "client closed the connection"
                raise
            # The router is stopping and this request outlived the grace period.
            ended = shut_down()
            call.fail(ended)
            await answer_error(reply, call, ended)
        finally:
            self._tasks.discard(task)
            self._record(call)

    def _admit(self, reply: Reply, endpoint: Endpoint) -> Call:
        """The request's record, its deadline and its trace, as it arrives."""
        call = Call(
            request_id=new_id(),
            client_request_id=reply.header("X-Request-Id"),
            endpoint=endpoint,
            arrival=time.perf_counter(),
            deadline=asyncio.get_running_loop().time() + self.config.serving.request_timeout_s,
        )
        traceparent = reply.header("traceparent")
        if self.tracer is not None:
            call.trace = self.tracer.begin(call, traceparent, reply.header("tracestate"))
        elif traceparent is not None:
            call.trace_lines = passthrough(traceparent, reply.header("tracestate"))
        self.in_flight += 1
        for arrived in self.arrival_hooks:
            arrived(call)
        return call

    def _record(self, call: Call) -> None:
        """The request's one outcome, told to every hook once."""
        self.in_flight -= 1
        now = time.perf_counter()
        call.finish(now)
        if call.trace is not None:
            call.trace.end(call, now)
        for hook in self.call_hooks:
            hook(call, now)

    async def _serve(self, reply: Reply, call: Call) -> None:
        config = self.config
        body = await reply.body(config.server.client_timeout_s)
        request = parse_client_request(call.endpoint, body, config.model)
        target = self.fleet.catalog.resolve(request.body["model"])
        # An alias goes to the engines as the name they serve.
        request.body["model"] = target.served
        call.model, call.adapter = target.base, target.adapter
        call.stream = request.stream
        if self.admission is not None:
            self.admission.admit(call, request, reply.header("Authorization"))
        if request.ask is not None:
            await self._respond(reply, call, request, target)
            return
        progress = tracker(config.continuation, request)
        call.tracks_ids = progress is not None
        first = FirstTries(
            self.fleet, request, self.outcome.budget, config.serving.max_attempts, target
        )
        if progress is not None:
            rescue = Rescue(
                self.fleet,
                self.retries,
                reply,
                call,
                request,
                progress,
                first.key,
                config.continuation,
                target,
            )
            await rescue.serve(first)
            return

        if self.whole and not request.stream:
            # A continuable request never comes here: continuing needs a streamed decode.

            async def forward_answer(answer: WholeAnswer) -> None:
                self._first_token(call)
                await forward(reply, call, answer)

            whole = await self.retries.run_whole(call, first, forward_answer)
            if whole.error is not None:
                raise whole.error
            self.outcome.answered(tracked=False)
            return

        async def answer(stream: DecodeStream) -> None:
            self._first_token(call)
            if request.stream:
                await relay(reply, call, stream)
            else:
                await collect(reply, call, stream)

        relayed = await self.retries.run(call, first, answer)
        if relayed.error is not None:
            error = relayed.error
            if error.is_engine_fault and error.engine == relayed.reservation.consumer.id:
                not_continued(call, request, config.continuation)
            raise error
        self.outcome.answered(tracked=False)

    async def _respond(
        self, reply: Reply, call: Call, request: ClientRequest, target: Target
    ) -> None:
        """A Responses request: its conversation rebuilt, its tries, its response kept."""
        conversations = self.conversations
        assert conversations is not None
        request, ancestors = await conversations.engine_request(call, request)
        first = FirstTries(
            self.fleet,
            request,
            self.outcome.budget,
            self.config.serving.max_attempts,
            target,
        )

        async def keep(response: dict[str, Any], encoded: bytes) -> None:
            await conversations.keep(call, request, ancestors, response, encoded)

        settings = self.config.continuation
        on = settings.enabled and settings.max_attempts > 0
        why = ineligible(request.body) if on else None
        if on and why is None:
            rescue = ResponsesRescue(
                self.fleet, self.retries, reply, call, request, first.key, settings, target, keep
            )
            await rescue.serve(first)
            return

        async def answer(stream: ResponsesStream) -> None:
            self._first_token(call)
            if request.stream:
                await relay_events(reply, call, stream, keep)
            else:
                await answer_whole(reply, call, stream, keep)

        relayed = await self.retries.run_responses(call, first, answer)
        error = relayed.error
        if error is not None:
            if error.is_engine_fault and error.engine == relayed.reservation.consumer.id:
                # Cut after output began: why it was not continued.
                call.cut = True
                refused = "continuation is off" if why is None else f"{why} cannot be continued"
                call.continuation_refused = refused
                call.refused_kind = OFF if why is None else ANSWER
            raise error
        self.outcome.answered(tracked=False)

    def _first_token(self, call: Call) -> None:
        """The request's first token (or whole answer) goes out to its client."""
        for hook in self.first_token_hooks:
            hook(call, call.stage_at)

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new requests, let running ones finish for `grace_s`,
        then end the rest (a terminal error event on committed streams)."""
        self.draining = True
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        remaining = [task for task in self._tasks if not task.done()]
        for task in remaining:
            self._shutdown_cancelled.add(task)
            task.cancel()
        if remaining:
            await asyncio.wait(remaining, timeout=5.0)

    def _shut_out(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether this cancellation is the router's own shutdown, not the client leaving."""
        if task is None or task not in self._shutdown_cancelled:
            return False
        self._shutdown_cancelled.discard(task)
        task.uncancel()
        return True
