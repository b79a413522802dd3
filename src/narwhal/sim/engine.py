"""One simulated vLLM engine: its HTTP routes, the request path, its lifecycle and its faults.

The request path reads top to bottom in `_serve_inference`: validate → pick a fault → open the
response → take a seat → process the prompt (compute, cache hit or KV pull) → generate →
answer (with a descriptor for a prefill). Everything a "process" owns lives in a `_Launch`,
so a crash drops it and a restart builds a new one on the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import ssl
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from narwhal.sim.api import ApiError, InferenceRequest, Route, parse_request
from narwhal.sim.faults import ArmedFaults, Fault, FaultError
from narwhal.sim.kv import (
    HeldBlocks,
    PrefixCache,
    PullError,
    SideChannel,
    block_digests,
    pull_blocks,
    renew_lease_every,
)
from narwhal.sim.model import Generation
from narwhal.sim.options import SimOptions
from narwhal.sim.outputs import JsonOutput, Output, SseOutput, error_response
from narwhal.sim.responses import StreamEncoder, Usage
from narwhal.sim.scheduler import Scheduler, Seat

ZERO_INTERVAL_BATCH = 32
"""Tokens generated per transport write when there is no inter-token interval."""

KEEP_ALIVE_INTERVAL_S = 0.1
"""How often a silent stream with `silence_metadata` sends a keep-alive comment."""

KEEPALIVE_TIMEOUT_S = 5.0
"""vLLM (uvicorn) closes idle keep-alive connections after 5 s."""


RECEIVED_KEPT = 1024
"""How many recent inference requests an engine remembers for inspection."""


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

    @property
    def body(self) -> Any:
        return orjson.loads(self.raw)


@dataclass(slots=True)
class _Counters:
    """What `/metrics` counts, as vLLM 0.32 names it: prompt tokens by where their KV came
    from (`vllm:prompt_tokens_by_source`) and the NixlConnector's failed and expired pulls."""

    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    generation_tokens: int = 0
    nixl_failed_transfers: int = 0
    nixl_expired_requests: int = 0

    def expired(self) -> None:
        self.nixl_expired_requests += 1


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A processed prompt: its block digests and where its tokens' KV came from."""

    digests: list[bytes]
    tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _Launch:
    """What one engine process owns; a crash discards it, a restart makes a new one."""

    engine_id: str
    start_time: float
    scheduler: Scheduler
    holds: HeldBlocks
    prefix_cache: PrefixCache
    faults: ArmedFaults
    counters: _Counters


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
        self._side_channel = SideChannel(lambda: self._launch.engine_id, lambda: self._launch.holds)
        self._port = options.port
        self._side_channel_port = options.side_channel_port
        self._reopen: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[object]] = set()
        self.received: deque[Received] = deque(maxlen=RECEIVED_KEPT)

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
        """`system_fingerprint`, shaped as vLLM 0.32's default: version and a config hash."""
        options = self.options
        config = f"{options.model}|{options.kv_block_size}|{options.tp_size}|{options.device}"
        digest = hashlib.blake2b(config.encode(), digest_size=4).hexdigest()
        return f"vllm-{options.version}-{digest}"

    # -- faults and observation ------------------------------------------------------------

    def set_fault(self, fault: Fault) -> None:
        """Arm one fault, replacing any armed before (as `POST /sim/faults`)."""
        self._launch.faults.replace([fault])

    def clear_faults(self) -> None:
        self._launch.faults.replace([])

    def held_block_count(self) -> int:
        """KV blocks currently held for remote pulls."""
        return self._launch.holds.block_count()

    def running_count(self) -> int:
        return self._launch.scheduler.running

    def waiting_count(self) -> int:
        return self._launch.scheduler.waiting

    # -- the request path ------------------------------------------------------------------

    async def _inference(self, request: web.Request, route: Route) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            return await self._serve_inference(request, route)
        finally:
            self._in_flight.discard(task)

    async def _serve_inference(self, request: web.Request, route: Route) -> web.StreamResponse:
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
            )
        )
        try:
            inference = parse_request(
                raw,
                route,
                model=self.options.model,
                max_model_len=self.options.max_model_len,
            )
            fault = self._fault_for(request, inference, launch)
            blocks = self._blocks_needed(inference)
        except ApiError as error:
            return error_response(error)
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        response_id = ("chatcmpl-" if route == "chat" else "cmpl-") + request_id
        output: Output
        options = self.options
        if inference.stream:
            encoder = StreamEncoder(
                route,
                response_id,
                created,
                options.model,
                fingerprint=self.fingerprint,
                reasoning_field=options.reasoning_field,
                prompt_token_ids=inference.prompt_tokens if inference.return_token_ids else None,
            )
            output = SseOutput(request, inference, encoder, options.reasoning_tokens)
        else:
            output = JsonOutput(
                request,
                inference,
                response_id,
                created,
                options.model,
                fingerprint=self.fingerprint,
                reasoning_tokens=options.reasoning_tokens,
                reasoning_field=options.reasoning_field,
            )

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
            async with self._renewing_lease(inference):
                seat = await launch.scheduler.admit(blocks)
            try:
                prompt = await self._process_prompt(launch, inference, fault, response_id)
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
            )
            await output.begin()
            cut_short = await self._generate(launch, generation, output, fault)
            if cut_short is not None:
                return cut_short
            launch.counters.generation_tokens += generation.completion_tokens
            descriptor = None
            if inference.is_prefill and not inference.stream:
                descriptor = self._hold_for_pull(
                    launch, seat, generation, prompt, response_id, fault
                )
            return await output.finish(
                generation, self._usage(inference, generation, prompt), descriptor
            )
        except ConnectionError:
            # The client went away mid-stream: its request is over.
            return output.abort()
        finally:
            if seat is not None:
                launch.scheduler.release(seat)

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

    async def _process_prompt(
        self, launch: _Launch, inference: InferenceRequest, fault: Fault, response_id: str
    ) -> _Prompt:
        """Pay for the prompt (pull, cache hit or compute) and count where its KV came from."""
        options = self.options
        block_size = options.kv_block_size
        tokens = inference.prompt_tokens
        digests = block_digests(tokens, block_size)
        full_blocks = len(tokens) // block_size
        local_tokens = launch.prefix_cache.cached_blocks(digests[:full_blocks]) * block_size
        cached_tokens = local_tokens
        if inference.is_remote_decode:
            assert inference.kv_transfer_params is not None
            try:
                await self._pull(inference.kv_transfer_params, fault, digests, response_id)
                # The pulled blocks cover the prompt; the last token is recomputed.
                cached_tokens = len(tokens)
            except PullError as exc:
                launch.counters.nixl_failed_transfers += 1
                if options.kv_load_failure_policy == "fail":
                    raise ApiError(500, f"KV transfer failed: {exc}") from exc
        compute_tokens = max(1, len(tokens) - cached_tokens)
        counters = launch.counters
        counters.local_compute += compute_tokens
        counters.local_cache_hit += min(local_tokens, len(tokens) - compute_tokens)
        counters.external_kv_transfer += max(0, len(tokens) - compute_tokens - local_tokens)
        await asyncio.sleep(
            options.request_overhead_s
            + compute_tokens * options.prefill_s_per_token * self._slowdown(launch)
        )
        launch.prefix_cache.add(digests[:full_blocks])
        return _Prompt(digests, len(tokens), min(local_tokens, len(tokens) - compute_tokens))

    def _usage(self, inference: InferenceRequest, generation: Generation, prompt: _Prompt) -> Usage:
        """The request's usage as vLLM 0.32 reports it.

        Cached tokens (only with `enable_prompt_tokens_details`) are the local prefix-cache
        hits; a decode whose KV came over the side channel reports the producer's own
        hits instead (`remote_prefill_cached_tokens`), not the pulled tokens: so 0 for a
        prompt the producer computed. Reasoning tokens are counted when a reasoning parser
        is on (chat only).
        """
        options = self.options
        cached = None
        if options.enable_prompt_tokens_details:
            cached = prompt.cached_tokens
            params = inference.kv_transfer_params
            remote = params.get("remote_prefill_cached_tokens") if params else None
            if inference.is_remote_decode and type(remote) is int:
                cached = remote
        reasoning = None
        if options.reasoning_tokens and inference.route == "chat":
            reasoning = min(options.reasoning_tokens, generation.completion_tokens)
        return Usage(len(inference.prompt_tokens), generation.completion_tokens, cached, reasoning)

    @contextlib.asynccontextmanager
    async def _renewing_lease(self, inference: InferenceRequest) -> AsyncIterator[None]:
        """While a decode waits for a seat, keep the producer's blocks: as vLLM's consumer
        sends heartbeats every sixth of the lease until it loads the KV."""
        params = inference.kv_transfer_params
        if not inference.is_remote_decode or params is None:
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
        interval = self.options.kv_lease_s / 6
        heartbeat = asyncio.create_task(
            renew_lease_every(interval, host, port, engine_id, request_id)
        )
        try:
            yield
        finally:
            heartbeat.cancel()

    async def _pull(
        self,
        params: Mapping[str, object],
        fault: Fault,
        digests: list[bytes],
        response_id: str,
    ) -> None:
        """Pull the prompt's blocks from the producer named by the descriptor and check them."""
        host, port = params.get("remote_host"), params.get("remote_port")
        engine_id, block_ids = params.get("remote_engine_id"), _flat_block_ids(params)
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(engine_id, str):
            raise PullError("malformed descriptor: remote_host, remote_port, remote_engine_id")
        if block_ids is None:
            raise PullError("malformed descriptor: remote_block_ids")
        if len(block_ids) != len(digests):
            raise PullError(f"{len(block_ids)} blocks offered, the prompt has {len(digests)}")
        request_id = params.get("remote_request_id")
        await asyncio.sleep(
            fault.kv_pull_delay_s + len(block_ids) * self.options.kv_pull_s_per_block
        )
        if fault.kv_pull_fail:
            raise PullError("simulated fault: KV pull failed")
        pulled = await pull_blocks(
            host,
            port,
            engine_id,
            request_id if isinstance(request_id, str) else response_id,
            block_ids,
        )
        if pulled != digests:
            raise PullError("pulled blocks do not match the prompt")

    async def _generate(
        self, launch: _Launch, generation: Generation, output: Output, fault: Fault
    ) -> web.StreamResponse | None:
        """Generate until finished; a fault that ends the request early returns its answer."""
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
                await self._silence(output, fault)
            if fault.close_after == sent:
                return output.abort()
            if fault.crash_after == sent:
                self._crash_by_fault()
                return output.abort()
            if fault.error_after == sent:
                return await output.fail(
                    ApiError(fault.error_code, f"simulated fault: error after {sent} tokens")
                )
            # Up to the next fault mark: one token per write when tokens are paced, a batch
            # per write when they are not, everything at once when nobody watches the stream.
            count = min((k for k in marks if k > sent), default=generation.max_tokens) - sent
            if output.streaming:
                count = min(count, 1 if self.options.inter_token_s else ZERO_INTERVAL_BATCH)
            texts: list[str] = []
            while len(texts) < count and generation.finish_reason is None:
                texts.append(generation.step())
            # Token 0 comes out of the prefill; every later token costs one decode step.
            await self._decode_steps(launch, len(texts) - (sent == 0))
            await output.tokens(texts, generation)
        return None

    async def _decode_steps(self, launch: _Launch, steps: int) -> None:
        """Wait out decode steps; with no interval, still let other streams run."""
        await asyncio.sleep(steps * self.options.inter_token_s * self._slowdown(launch))

    async def _silence(self, output: Output, fault: Fault) -> None:
        if not fault.silence_metadata:
            await asyncio.sleep(fault.silence_s)
            return
        deadline = asyncio.get_running_loop().time() + fault.silence_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.sleep(min(KEEP_ALIVE_INTERVAL_S, left))
            await output.keep_alive()

    def _slowdown(self, launch: _Launch) -> float:
        """Steps get slower as more sequences share the batch."""
        return 1 + self.options.slowdown_per_seq * max(0, launch.scheduler.running - 1)

    def _hold_for_pull(
        self,
        launch: _Launch,
        seat: Seat,
        generation: Generation,
        prompt: _Prompt,
        response_id: str,
        fault: Fault,
    ) -> dict[str, object] | None:
        """A prefill keeps its prompt blocks for the consumer and describes them.

        Like vLLM, only a prefill that stopped on its length cap hands off; otherwise (or
        with a malformed-descriptor fault) nothing is held. The descriptor has vLLM
        0.32's members in its order (a pull-mode NixlConnector with one KV-cache group).
        """
        if generation.finish_reason != "length" or fault.descriptor == "null":
            return None
        digests = prompt.digests
        block_ids = seat.block_ids[: len(digests)]
        if fault.descriptor is None:
            block_ids = launch.scheduler.release(seat, keep=len(digests))
            launch.holds.hold(response_id, block_ids, digests)
        descriptor: dict[str, object] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # One list per KV-cache group, as vLLM 0.32 sends them (one group here).
            "remote_block_ids": [block_ids],
            "remote_engine_id": launch.engine_id,
            "remote_request_id": response_id,
            "remote_host": self.options.resolved_side_channel_host,
            "remote_port": self._side_channel_port,
            "tp_size": self.options.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt.tokens,
            # Only a consumer's own held blocks carry an expiry time; a producer's lease
            # is renewed by heartbeats instead.
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": prompt.cached_tokens,
        }
        if fault.descriptor == "missing_engine_id":
            del descriptor["remote_engine_id"]
        elif fault.descriptor == "non_integer_block_ids":
            descriptor["remote_block_ids"] = [[str(block_id) for block_id in block_ids]]
        elif fault.descriptor == "negative_block_ids":
            descriptor["remote_block_ids"] = [[-1 - block_id for block_id in block_ids]]
        return descriptor

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

    async def _settle(self) -> None:
        """Give aborted connections' handlers a moment to see the loss and clean up."""
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=1.0)

    def _new_launch(self) -> _Launch:
        options = self.options
        scheduler = Scheduler(options.max_num_seqs, options.num_kv_blocks)
        counters = _Counters()
        return _Launch(
            engine_id=options.engine_id or uuid.uuid4().hex,
            start_time=time.time(),
            scheduler=scheduler,
            holds=HeldBlocks(options.kv_lease_s, scheduler.free_blocks, counters.expired),
            prefix_cache=PrefixCache(options.num_kv_blocks),
            faults=ArmedFaults(options.faults),
            counters=counters,
        )

    # -- routes ----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat_completions),
            ("GET", "/health", self._health),
            ("GET", "/v1/models", self._models),
            ("GET", "/version", self._version),
            ("GET", "/metrics", self._metrics),
            ("GET", "/sim/identity", self._identity),
        ]
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

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.options.model,
            "object": "model",
            "created": int(self._launch.start_time),
            "owned_by": "vllm",
            "root": self.options.model,
            "parent": None,
            "max_model_len": self.options.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self._launch.engine_id[:16]}",
                    "object": "model_permission",
                    "created": int(self._launch.start_time),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return _json({"object": "list", "data": [model]})

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": self.options.version})

    async def _identity(self, request: web.Request) -> web.Response:
        return _json(
            {
                "engine_version": self.options.version,
                "model": self.options.model,
                "connector": "NixlConnector",
                "block_size": self.options.kv_block_size,
                "tp_size": self.options.tp_size,
                "engine_id": self.engine_id,
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text with vLLM 0.32's series names and labels (a subset of them)."""
        launch = self._launch
        scheduler, counters, options = launch.scheduler, launch.counters, self.options
        labels = f'model_name="{options.model}",engine="0"'
        lines: list[str] = []

        def series(kind: str, name: str, help_text: str, values: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            suffix = "_total" if kind == "counter" else ""
            lines.extend(f"{name}{suffix}{{{extra}}} {float(value)}" for extra, value in values)

        series(
            "gauge",
            "vllm:num_requests_running",
            "Requests in the running batch.",
            [(labels, scheduler.running)],
        )
        series(
            "gauge",
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
            [(labels, scheduler.waiting)],
        )
        series(
            "gauge",
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 means 100 percent.",
            [(labels, scheduler.kv_usage)],
        )
        # An info metric: a gauge at 1 whose labels are the cache configuration.
        cache_config = (
            f'block_size="{options.kv_block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",num_gpu_blocks="{options.num_kv_blocks}",'
            'engine="0"'
        )
        series(
            "gauge",
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [(cache_config, 1)],
        )
        sources = {
            "local_compute": counters.local_compute,
            "local_cache_hit": counters.local_cache_hit,
            "external_kv_transfer": counters.external_kv_transfer,
        }
        prompt_tokens = sum(sources.values())
        series(
            "counter",
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            [(labels, prompt_tokens)],
        )
        series(
            "counter",
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [(f'{labels},source="{source}"', value) for source, value in sources.items()],
        )
        series(
            "counter",
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            [(labels, prompt_tokens - counters.local_compute)],
        )
        series(
            "counter",
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            [(labels, counters.generation_tokens)],
        )
        series(
            "counter",
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers.",
            [(labels, counters.nixl_failed_transfers)],
        )
        series(
            "counter",
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire.",
            [(labels, counters.nixl_expired_requests)],
        )
        lines += [
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {launch.start_time}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

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
