"""Tracing switched on the standard way, by `OTEL_*` variables alone, reaches a receiver.

`narwhal serve` runs as its own process with no `[tracing]` table; the environment names
an OTLP/HTTP endpoint served here, which decodes each export as a collector would
(`ExportTraceServiceRequest` protobuf). The spans that arrive belong to the client's trace,
name the service, form the request's tree, and are the parents each engine leg carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from aiohttp import web
from openai import AsyncOpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from narwhal.tools.sim.fleet import SimFleet
from support.stack import FAST, MODEL, serve_process

WAIT_S = 90.0
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[tuple[str, list[tuple[str, Span]]]]:
    """An OTLP/HTTP traces endpoint keeping every span it is sent, with its service name."""
    spans: list[tuple[str, Span]] = []

    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in message.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                spans.extend((service, span) for span in scope_spans.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", spans
    finally:
        await runner.cleanup()


async def test_otel_variables_alone_export_the_request_tree_to_an_otlp_receiver(
    tmp_path: Path,
) -> None:
    async with (
        receiver() as (endpoint, spans),
        SimFleet([replace(FAST, name="p0"), replace(FAST, name="d0")]) as sims,
    ):
        producer, consumer = sims.engines
        config = tmp_path / "fleet.toml"
        config.write_text(
            f'model = "{MODEL}"\n'
            f'[[engines]]\nid = "p0"\nurl = "{producer.url}"\nrole = "prefill"\n'
            f'[[engines]]\nid = "d0"\nurl = "{consumer.url}"\nrole = "decode"\n'
        )
        environment = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_SERVICE_NAME": "narwhal-under-test",
            # Export each batch at once rather than every five seconds.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        log = tmp_path / "log"
        async with serve_process(config, log, environment, WAIT_S) as (process, router):
            client = AsyncOpenAI(
                base_url=router + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S
            )
            answer = await client.completions.create(
                model=MODEL,
                prompt="The tide comes in",
                max_tokens=4,
                extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            )
            assert answer.choices[0].text
            for _ in range(int(WAIT_S * 10)):
                if any(span.name == "narwhal.relay" for _, span in spans):
                    break
                await asyncio.sleep(0.1)
        assert process.returncode == 0, log.read_text()

    names = {span.name for _, span in spans}
    assert {"narwhal.attempt", "narwhal.prefill", "narwhal.decode", "narwhal.relay"} <= names
    assert {service for service, _ in spans} == {"narwhal-under-test"}
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}
    (root,) = [span for _, span in spans if span.parent_span_id.hex() == CLIENT_SPAN]
    assert root.kind == Span.SpanKind.SPAN_KIND_SERVER
    by_id = {span.span_id.hex(): span for _, span in spans}
    for _, span in spans:
        if span is not root:
            assert span.parent_span_id.hex() in by_id, span.name
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.start_time_unix_nano <= span.end_time_unix_nano <= root.end_time_unix_nano
    legs = {"narwhal.prefill": producer, "narwhal.decode": consumer}
    for name, engine in legs.items():
        (leg,) = [span for _, span in spans if span.name == name]
        (seen,) = [r.traceparent for r in engine.received if r.traceparent]
        assert seen is not None and seen.split("-")[1:3] == [TRACE_ID, leg.span_id.hex()]
