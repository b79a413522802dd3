"""How a worker answers for the whole router: a middleware in front of its routes.

| request (from a client)            | answered by                                         |
|------------------------------------|-----------------------------------------------------|
| `GET /metrics`                     | every worker's own metrics, merged (`merge_metrics`)|
| `GET /narwhal/state`               | every worker's own state, merged (`merge_state`)    |
| `POST`/`PATCH`/`DELETE /narwhal/…` | this worker, then, if it succeeded, every other     |
|   (the admin API, reload)          |   worker: the same request over its Unix socket     |
| anything else                      | this worker alone                                   |

Requests arriving over a worker's Unix socket are its peers' (or the supervisor's): they
get that worker's own answer, never a merged one, so nothing fans out twice. An admin
change is judged by each worker against its own view of the fleet: the answer is this
worker's, with `X-Narwhal-Workers: applied/asked`, and a peer that refused is logged.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from narwhal.workers.merge_metrics import Families, merge_expositions, sample_total
from narwhal.workers.merge_state import merge_states
from narwhal.workers.peers import PeerAnswer, Peers
from narwhal.workers.status import read_retired, read_status

log = logging.getLogger("narwhal.workers")
CHANGES = frozenset({"POST", "PATCH", "DELETE"})
# What a peer needs of the client's request to judge it as this worker did.
FORWARDED = ("Authorization", "Content-Type")


def fan_out(peers: Peers) -> Middleware:
    """The middleware for one worker of `peers.count`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        method, path = request.method, request.path
        # Client requests first: the request path pays one prefix check and nothing more.
        if path.startswith("/v1/") or _from_peer(request):
            return await handler(request)
        if method == "GET" and path == "/metrics":
            return await _metrics(request, peers)
        if method == "GET" and path == "/narwhal/state":
            return await _state(request, peers)
        if method in CHANGES and path.startswith("/narwhal/"):
            return await _everywhere(request, handler, peers)
        return await handler(request)

    return middleware


def _from_peer(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def _forwarded(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED if name in request.headers}


async def _metrics(request: web.Request, peers: Peers) -> web.StreamResponse:
    answers = await peers.ask("GET", "/metrics", headers=_forwarded(request))
    texts = [a.body.decode() for a in answers.values() if a is not None and a.status == 200]
    retired = read_retired(peers.run_dir)
    merged = merge_expositions(texts, [text for each in retired.values() for text in each])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families([*merged, *_worker_metrics(peers, answers, retired)]))
    # Always the classic text format: merged counters keep their `_created` series as
    # the gauges that format has them as.
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def _worker_metrics(
    peers: Peers, answers: dict[int, PeerAnswer | None], retired: dict[int, list[str]]
) -> list[Metric]:
    up = GaugeMetricFamily(
        "narwhal_worker_up", "Whether the worker answered this scrape.", labels=["worker"]
    )
    served = CounterMetricFamily(
        "narwhal_worker_requests",
        "Finished client requests by the worker number that served them.",
        labels=["worker"],
    )
    for worker, answer in answers.items():
        answered = answer is not None and answer.status == 200
        up.add_metric([str(worker)], float(answered))
        texts = retired.get(worker, []) + ([answer.body.decode()] if answer and answered else [])
        total = sum(sample_total(text, "narwhal_requests_total") for text in texts)
        served.add_metric([str(worker)], total)
    restarts = CounterMetricFamily(
        "narwhal_worker_restarts",
        "Worker processes the supervisor replaced after they exited.",
        labels=["worker"],
    )
    lost = CounterMetricFamily(
        "narwhal_worker_lost_requests",
        "Requests a worker was serving when it exited (each journaled by the supervisor).",
        labels=["worker"],
    )
    status = read_status(peers.run_dir)
    for slot in status["slots"] if status else ():
        restarts.add_metric([str(slot["worker"])], slot["restarts"])
        lost.add_metric([str(slot["worker"])], slot["lost"])
    return [up, served, restarts, lost]


async def _state(request: web.Request, peers: Peers) -> web.StreamResponse:
    answers = await peers.ask("GET", "/narwhal/state", headers=_forwarded(request))
    snapshots = {
        worker: orjson.loads(answer.body)
        for worker, answer in answers.items()
        if answer is not None and answer.status == 200
    }
    if not snapshots:
        raise web.HTTPServiceUnavailable(reason="no worker answered")
    merged = merge_states(snapshots)
    merged["workers"] = _workers_entry(peers, snapshots)
    return web.Response(body=orjson.dumps(merged), content_type="application/json")


def _workers_entry(peers: Peers, snapshots: dict[int, dict[str, Any]]) -> dict[str, Any]:
    status = read_status(peers.run_dir)
    slots = {slot["worker"]: slot for slot in status["slots"]} if status else {}
    return {
        "count": peers.count,
        "answered": sorted(snapshots),
        "each": [
            {
                "worker": worker,
                "answered": worker in snapshots,
                "in_flight": snapshots[worker]["in_flight"] if worker in snapshots else None,
                "pid": slots.get(worker, {}).get("pid"),
                "restarts": slots.get(worker, {}).get("restarts", 0),
                "last_exit": slots.get(worker, {}).get("last_exit"),
                "lost_requests": slots.get(worker, {}).get("lost", 0),
            }
            for worker in range(peers.count)
        ],
    }


async def _everywhere(request: web.Request, handler: Handler, peers: Peers) -> web.StreamResponse:
    body = await request.read()
    response = await handler(request)
    if response.status >= 300:
        return response
    answers = await peers.ask(
        request.method, request.path_qs, body=body, headers=_forwarded(request), others_only=True
    )
    applied = 1
    for worker, answer in answers.items():
        if answer is not None and answer.status < 300:
            applied += 1
        else:
            log.warning(
                "worker %d did not apply %s %s: %s",
                worker,
                request.method,
                request.path,
                "unreachable" if answer is None else f"{answer.status} {answer.body[:200]!r}",
            )
    response.headers["X-Narwhal-Workers"] = f"{applied}/{peers.count}"
    return response
