"""Seat limits across many routers: each router process's share, and the others' load.

An engine's `max_prefill_seats` and `max_decode_seats` are limits on the engine, whoever
sends it work. Seats are counted by each router process for itself, so each process takes
a fixed share of every limit, and the shares add up to no more than the limit:

| setting                                 | share of a limit L, for worker w of N               |
|-----------------------------------------|-----------------------------------------------------|
| one process (the default)               | L                                                   |
| `server.replicas = R` (router replicas, | floor(L / R) per replica (each replica alone; the   |
|   e.g. pods of one Deployment)          |   remainder is left unused)                         |
| `--workers N` in each                   | that split over the workers: floor(. / N), the      |
|                                         |   remainder one each to the lowest-numbered workers |
| L = 0 (unlimited)                       | unlimited                                           |

A share can be 0 (a limit below the number of processes): that process never places on
the engine. The engine's own report (`vllm:num_requests_running` + `…_waiting`, read every
`engine.metrics_interval_s`) adds what the other routers have on it to placement's load
estimate, so that every router steers away from an engine others have filled; the shares
are what keeps the limit, whatever the reports' age.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeatShare:
    """Which part of the fleet's seats this router process holds."""

    replicas: int = 1
    workers: int = 1
    worker: int = 0

    def of(self, limit: int) -> int | None:
        """This process's seats of an engine limit `limit`; None: unlimited."""
        if limit == 0:
            return None
        base, extra = divmod(limit // self.replicas, self.workers)
        return base + (1 if self.worker < extra else 0)


WHOLE = SeatShare()


def others_load(running: float | None, waiting: float | None, own_seats: int) -> float:
    """Requests on an engine that are not this process's, from its report: all it runs and
    queues, less the seats this process held when the report was taken."""
    return max(0.0, (running or 0.0) + (waiting or 0.0) - own_seats)
