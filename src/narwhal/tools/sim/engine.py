"""One simulated vLLM engine: its HTTP routes, the request path, its lifecycle and its faults.

The request path reads top to bottom in `_serve_inference`: validate → pick a fault → open the
response → take a seat → process the prompt (compute, cache hit or KV pull) → generate →
answer (with a descriptor for a prefill). Everything a "process" owns lives in a `_Launch`,
so a crash drops it and a restart builds a new one on the same ports.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from narwhal.tools.sim.api import (
    PRIORITY_HEADER,
    ApiError,
    Endpoint,
    InferenceRequest,
    Route,
    parse_request,
    request_priority,
)
from narwhal.tools.sim.describe import fingerprint, identity, models
from narwhal.tools.sim.faults import ArmedFaults, Fault, FaultError
from narwhal.tools.sim.generate import stream_tokens
from narwhal.tools.sim.handoff import (
    Handoff,
    descriptor,
    handoff_report,
    rejected_handoff,
    release_rejected,
    renewing_lease,
)
from narwhal.tools.sim.kv import (
    HeldBlocks,
    PrefixCache,
    SideChannel,
    block_digests,
)
from narwhal.tools.sim.lora import LoraRegistry, lora_routes
from narwhal.tools.sim.metrics import Counters, render_metrics
from narwhal.tools.sim.model import Generation
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.outputs import JsonOutput, Output, SseOutput, error_response
from narwhal.tools.sim.prompt import Prompt, process_prompt, usage
from narwhal.tools.sim.responses import StreamEncoder
from narwhal.tools.sim.responses_api import ResponsesCall, parse_responses_request
from narwhal.tools.sim.responses_stream import responses_output, responses_usage
from narwhal.tools.sim.scheduler import Scheduler, Seat
from narwhal.tools.sim.steps import StepLoop

KEEPALIVE_TIMEOUT_S = 5.0
"""vLLM (uvicorn) closes idle keep-alive connections after 5 s."""


LISTEN_BACKLOG = 2048
"""uvicorn's (so vLLM's) listen backlog; asyncio's default of 100 drops connections in a
burst of requests, which a GPU engine's server would have queued."""

RECEIVED_KEPT = 1024
"""How many recent inference requests (and KV pulls) an engine remembers for inspection."""


@dataclass(frozen=True, slots=True)
class Received:
    """One inference request as it arrived, so callers can check what a router sent."""

    path: str
    request_id: str | None
    raw: bytes
    authorization: str | None = None
    # The W3C trace context it carried, so tests can check what a router propagates.
    traceparent: str | None = None
    tracestate: str | None = None
    priority_header: str | None = None  # X-Vllm-Priority, which vLLM reads before the body

    @property
    def body(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def priority(self) -> int:
        """The `priority` it was scheduled with (raises ApiError if it was refused)."""
        return request_priority(self.body, self.priority_header)


@dataclass(slots=True)
class _Launch:
    """What one engine process owns; a crash discards it, a restart makes a new one."""

    engine_id: str
    start_time: float
    scheduler: Scheduler
    holds: HeldBlocks
    prefix_cache: PrefixCache
    faults: ArmedFaults
    counters: Counters
    steps: StepLoop
    # The LoRA adapters loaded: the start-up ones again after a restart, as vLLM's.
    loras: LoraRegistry


class SimEngine:
    """A vLLM-compatible engine with the NixlConnector's KV handoff, in this event loop."""

    def __init__(
        self,
        options: SimOptions,
        *,
        on_crash: Callable[[], None] | None = None,
        on_listening: Callable[[bool], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`on_crash` replaces the in-process crash for the `crash` fault (a CLI exits);
        `on_listening` is told each time the engine starts (True) or stops (False) accepting
        connections, whatever the reason (start, crash, restart, `refuse_s`, stop);
        `ssl_context` serves HTTPS, as an engine behind TLS would."""
        self.options = options
        self._on_crash = on_crash
        self._on_listening = on_listening
        self._ssl_context = ssl_context
        self._launch = self._new_launch()
        self._runner: web.AppRunner | None = None
        self._http: asyncio.Server | None = None
        self._side_channel = SideChannel(
            lambda: self._launch.engine_id, lambda: self._launch.holds, options.model
        )
        self._port = options.port
        self._side_channel_port = options.side_channel_port
        self._reopen: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[object]] = set()
        self.received: deque[Received] = deque(maxlen=RECEIVED_KEPT)
        # Every KV pull this engine made as a consumer, oldest first (across restarts).
        self.handoffs: deque[Handoff] = deque(maxlen=RECEIVED_KEPT)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving HTTP and the side channel (free ports when configured as 0).

        Faults armed before `start` stay armed; only `restart` makes a new engine identity.
        """
        if self._runner is None:
            self._runner = web.AppRunner(
                self._app(),
                handle_signals=False,
                access_log=None,
                handler_cancellation=True,
                keepalive_timeout=KEEPALIVE_TIMEOUT_S,
            )
            await self._runner.setup()
        self._side_channel_port = await self._side_channel.listen(
            self.options.resolved_side_channel_host, self._side_channel_port
        )
        await self._listen()

    async def stop(self) -> None:
        """Stop serving; open requests are cut off."""
        self._drop_everything()
        await self._settle()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def crash(self) -> None:
        """Die like a killed process: cut every connection, close listeners, lose held blocks."""
        self._drop_everything()
        await self._settle()

    async def restart(self) -> None:
        """Come back on the same ports as a new process (new engine id and start time)."""
        await self.crash()
        self._launch = self._new_launch()
        await self.start()

    @property
    def url(self) -> str:
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{self.options.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def side_channel_port(self) -> int:
        return self._side_channel_port

    @property
    def engine_id(self) -> str:
        return self._launch.engine_id

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.options)

    # -- faults and observation ------------------------------------------------------------

    def set_fault(self, fault: Fault) -> None:
        """Arm one fault, replacing any armed before (as `POST /sim/faults`)."""
        self._launch.faults.replace([fault])

    def clear_faults(self) -> None:
        self._launch.faults.replace([])

    def held_block_count(self) -> int:
        """KV blocks currently held for remote pulls."""
        return self._launch.holds.block_count()

    def cached_prefix_tokens(self, tokens: Sequence[int], adapter: str | None = None) -> int:
        """How many of the prompt's leading tokens the prefix cache holds now (whole
        blocks computed with `adapter`, None the base model), without touching their
        recency."""
        size = self.options.kv_block_size
        digests = block_digests(tokens, size, adapter)[: len(tokens) // size]
        return self._launch.prefix_cache.peek(digests) * size

    @property
    def loras(self) -> LoraRegistry:
        """The LoRA adapters this engine serves now."""
        return self._launch.loras

    def crossed_handoffs(self) -> list[Handoff]:
        """The pulls whose KV came from another base model or other weights than the
        request's own: none, where a router keeps handoffs within one adapter."""
        return [h for h in self.handoffs if h.crossed_model or h.crossed_adapter]

    def running_count(self) -> int:
        return self._launch.scheduler.running

    def waiting_count(self) -> int:
        return self._launch.scheduler.waiting

    # -- the request path ------------------------------------------------------------------

    async def _inference(self, request: web.Request, route: Endpoint) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            return await self._serve_inference(request, route)
        finally:
            self._in_flight.discard(task)

    async def _serve_inference(self, request: web.Request, route: Endpoint) -> web.StreamResponse:
        launch = self._launch
        created = int(time.time())
        raw = await request.read()
        self.received.append(
            Received(
                request.path,
                request.headers.get("X-Request-Id"),
                raw,
                request.headers.get("Authorization"),
                request.headers.get("traceparent"),
                request.headers.get("tracestate"),
                request.headers.get(PRIORITY_HEADER),
            )
        )
        call: ResponsesCall | None = None
        try:
            if route == "responses":
                call = parse_responses_request(
                    raw,
                    model=self.options.model,
                    max_model_len=self.options.max_model_len,
                    adapters=launch.loras,
                    priority_header=request.headers.get(PRIORITY_HEADER),
                )
                inference = call.inference
            else:
                inference = parse_request(
                    raw,
                    route,
                    model=self.options.model,
                    max_model_len=self.options.max_model_len,
                    adapters=launch.loras,
                    priority_header=request.headers.get(PRIORITY_HEADER),
                )
            fault = self._fault_for(request, inference, launch)
            blocks = self._blocks_needed(inference)
        except ApiError as error:
            # Turned away before any work: a handoff it carried is released at its producer.
            rejected = rejected_handoff(raw)
            if rejected is not None:
                await release_rejected(rejected)
            return error_response(error)
        output: Output
        options = self.options
        if route == "responses":
            # The body's `request_id` names a Responses request (vLLM reads no X-Request-Id
            # there); the engine, its KV holds and its descriptor know it as sub-request 0.
            assert call is not None
            response_id = call.engine_request_id
            output = responses_output(request, call, created)
        else:
            request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            response_id = ("chatcmpl-" if route == "chat" else "cmpl-") + request_id
            output = self._output(request, route, inference, response_id, created)

        if fault.crash:
            self._crash_by_fault()
            return output.abort()
        if fault.refuse_s:
            self._refuse(fault.refuse_s)
            return output.abort()
        if fault.hang_s:
            await asyncio.sleep(fault.hang_s)
        if fault.status is not None:
            return error_response(ApiError(fault.status, f"simulated fault: HTTP {fault.status}"))

        seat: Seat | None = None
        try:
            await output.open()
            lease_params = inference.kv_transfer_params if inference.is_remote_decode else None
            async with renewing_lease(lease_params, options.kv_lease_s):
                seat = await launch.scheduler.admit(blocks, inference.priority)
            try:
                prompt = await process_prompt(
                    options,
                    inference,
                    fault,
                    response_id,
                    prefix_cache=launch.prefix_cache,
                    counters=launch.counters,
                    steps=launch.steps,
                    record=self.handoffs.append,
                )
            except ApiError as error:
                return await output.fail(error)
            if fault.first_token_delay_s:
                await asyncio.sleep(fault.first_token_delay_s)
            generation = Generation(
                inference.prompt_tokens,
                inference.sampling,
                max_tokens=inference.max_tokens,
                stop=inference.stop,
                eos_probability=options.eos_probability,
                empty_probability=options.empty_token_probability,
                weights=prompt.weights,
            )
            await output.begin()
            cut_short = await self._generate(launch, prompt.tokens, generation, output, fault)
            if cut_short is not None:
                return cut_short
            launch.counters.generation_tokens += generation.completion_tokens
            descriptor = None
            # A streamed response, unlike a chat stream, can carry the descriptor (in its
            # `response.completed`).
            if inference.is_prefill and (not inference.stream or call is not None):
                descriptor = self._hold_for_pull(
                    launch, seat, generation, prompt, response_id, fault, inference.adapter
                )
            count = usage if call is None else responses_usage
            return await output.finish(
                generation, count(options, inference, generation, prompt), descriptor
            )
        except ConnectionError:
            # The client went away mid-stream: its request is over.
            return output.abort()
        finally:
            if seat is not None:
                launch.scheduler.release(seat)

    def _output(
        self,
        request: web.Request,
        route: Route,
        inference: InferenceRequest,
        response_id: str,
        created: int,
    ) -> Output:
        """Where a completions or chat request's answer goes: a stream or one object."""
        options = self.options
        if inference.stream:
            encoder = StreamEncoder(
                route,
                response_id,
                created,
                inference.model,
                fingerprint=self.fingerprint,
                reasoning_field=options.reasoning_field,
                prompt_token_ids=inference.prompt_tokens if inference.return_token_ids else None,
            )
            return SseOutput(request, inference, encoder, options.reasoning_tokens)
        return JsonOutput(
            request,
            inference,
            response_id,
            created,
            inference.model,
            fingerprint=self.fingerprint,
            reasoning_tokens=options.reasoning_tokens,
            reasoning_field=options.reasoning_field,
        )

    def _fault_for(
        self, request: web.Request, inference: InferenceRequest, launch: _Launch
    ) -> Fault:
        """The per-request header wins over armed faults; no fault is an empty Fault."""
        if not self.options.faults_enabled:
            return _NO_FAULT
        header = request.headers.get("x-sim-fault")
        if header is not None:
            try:
                fault = Fault.parse(header)
            except FaultError as exc:
                raise ApiError(400, f"x-sim-fault: {exc}") from exc
            return fault if fault.applies_to(inference.phase) else _NO_FAULT
        return launch.faults.take(inference.phase) or _NO_FAULT

    def _blocks_needed(self, inference: InferenceRequest) -> int:
        blocks = math.ceil(
            (len(inference.prompt_tokens) + inference.max_tokens) / self.options.kv_block_size
        )
        if blocks > self.options.num_kv_blocks:
            raise ApiError(
                400,
                f"the request needs {blocks} KV blocks but the engine has "
                f"{self.options.num_kv_blocks}",
            )
        return blocks

    async def _generate(
        self,
        launch: _Launch,
        prompt_tokens: int,
        generation: Generation,
        output: Output,
        fault: Fault,
    ) -> web.StreamResponse | None:
        """Generate until finished; a fault that ends the request early returns its answer."""
        # Token 0 comes out of the prefill; every later token costs one decode step.
        decoding = launch.steps.decode(prompt_tokens + 1, generation.max_tokens - 1)
        try:
            paced = not self.options.step_costs.decode_is_free
            return await stream_tokens(
                decoding, generation, output, fault, paced=paced, crash=self._crash_by_fault
            )
        finally:
            decoding.leave()

    def _hold_for_pull(
        self,
        launch: _Launch,
        seat: Seat,
        generation: Generation,
        prompt: Prompt,
        response_id: str,
        fault: Fault,
        adapter: str | None,
    ) -> dict[str, object] | None:
        """A prefill keeps its prompt blocks for the consumer and describes them.

        Like vLLM, only a prefill that stopped on its length cap hands off; otherwise (or
        with a malformed-descriptor fault) nothing is held.
        """
        if generation.finish_reason != "length" or fault.descriptor == "null":
            return None
        digests = prompt.digests
        block_ids = seat.block_ids[: len(digests)]
        if fault.descriptor is None:
            block_ids = launch.scheduler.release(seat, keep=len(digests))
            launch.holds.hold(response_id, block_ids, digests, adapter)
        return descriptor(
            block_ids=block_ids,
            engine_id=launch.engine_id,
            response_id=response_id,
            host=self.options.resolved_side_channel_host,
            port=self._side_channel_port,
            tp_size=self.options.tp_size,
            prompt_tokens=prompt.tokens,
            cached_tokens=prompt.cached_tokens,
            fault=fault,
        )

    # -- faults that act on the whole engine -----------------------------------------------

    def _crash_by_fault(self) -> None:
        if self._on_crash is not None:
            self._on_crash()
        self._drop_everything()

    def _refuse(self, seconds: float) -> None:
        """Stop accepting connections for a while; idle keep-alive ones are closed too."""
        self._close_listener()
        if self._runner is not None and self._runner.server is not None:
            for connection in self._runner.server.connections:
                connection.close()
        self._reopen = asyncio.create_task(self._listen_after(seconds))

    async def _listen_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self._listen()

    async def _listen(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        self._reopen = None
        self._http = await asyncio.get_running_loop().create_server(
            self._runner.server,
            self.options.host,
            self._port,
            reuse_address=True,
            ssl=self._ssl_context,
            backlog=LISTEN_BACKLOG,
        )
        self._port = self._http.sockets[0].getsockname()[1]
        if self._on_listening is not None:
            self._on_listening(True)

    def _close_listener(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if self._http is not None:
            self._http.close()
            self._http = None
            if self._on_listening is not None:
                self._on_listening(False)

    def _drop_everything(self) -> None:
        self._close_listener()
        if self._runner is not None and self._runner.server is not None:
            for connection in self._runner.server.connections:
                if connection.transport is not None:
                    connection.transport.abort()
        for task in self._in_flight:
            task.cancel()
        self._side_channel.abort()
        self._launch.holds.drop_all()
        self._launch.steps.close()

    async def _settle(self) -> None:
        """Give aborted connections' handlers a moment to see the loss and clean up."""
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=1.0)

    def _new_launch(self) -> _Launch:
        options = self.options
        scheduler = Scheduler(
            options.max_num_seqs, options.num_kv_blocks, options.scheduling_policy
        )
        counters = Counters()
        return _Launch(
            engine_id=options.engine_id or uuid.uuid4().hex,
            start_time=time.time(),
            scheduler=scheduler,
            holds=HeldBlocks(options.kv_lease_s, scheduler.free_blocks, counters.expired),
            prefix_cache=PrefixCache(options.num_kv_blocks),
            faults=ArmedFaults(options.faults),
            counters=counters,
            steps=StepLoop(options.step_costs),
            loras=LoraRegistry(
                options.model, options.lora_modules, check_paths=options.check_lora_paths
            ),
        )

    # -- routes ----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat_completions),
            ("POST", "/v1/responses", self._responses),
            ("GET", "/health", self._health),
            ("GET", "/v1/models", self._models),
            ("GET", "/version", self._version),
            ("GET", "/metrics", self._metrics),
            ("GET", "/sim/identity", self._identity),
            ("GET", "/sim/handoffs", self._handoffs),
        ]
        if self.options.runtime_lora_updating:
            routes += lora_routes(lambda: self._launch.loras)
        if self.options.faults_enabled:
            routes += [
                ("GET", "/sim/faults", self._get_faults),
                ("POST", "/sim/faults", self._post_faults),
                ("DELETE", "/sim/faults", self._delete_faults),
            ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "completions")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "responses")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return _json(models(self.options, self._launch.loras))

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": self.options.version})

    async def _identity(self, request: web.Request) -> web.Response:
        return _json(identity(self.options, self.engine_id, self._launch.loras))

    async def _handoffs(self, request: web.Request) -> web.Response:
        return _json(handoff_report(self.handoffs))

    async def _metrics(self, request: web.Request) -> web.Response:
        launch = self._launch
        options, counters = self.options, launch.counters
        text = render_metrics(options, launch.scheduler, counters, launch.start_time)
        return web.Response(text=text, content_type="text/plain")

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json(self._launch.faults.to_json())

    async def _post_faults(self, request: web.Request) -> web.Response:
        """Arm the posted fault (or JSON list of faults), replacing what was armed."""
        try:
            body = orjson.loads(await request.read())
            values = body if isinstance(body, list) else [body]
            faults = [Fault.from_json(value) for value in values]
        except (FaultError, orjson.JSONDecodeError) as exc:
            return error_response(ApiError(400, str(exc)))
        self._launch.faults.replace(faults)
        return _json(self._launch.faults.to_json())

    async def _delete_faults(self, request: web.Request) -> web.Response:
        self.clear_faults()
        return _json([])


_NO_FAULT = Fault()


def _json(value: object) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")
