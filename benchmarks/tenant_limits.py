"""What a tenant's limits cost a request: admission and release, per call, in one process.

    python benchmarks/tenant_limits.py [--calls 200000]

For each store (`LocalStore`, and `SharedStore` over a file in tmpfs where there is one, as
the workers' run directory is) and each kind of tenant, it times `admit` + `release` and the
whole of what the router does for one request (`admit`, `headers`, `settle`, `release`),
and prints microseconds per call, the best of five rounds. The limits are set high enough
that nothing is refused: this is the cost of the usual request.

| tenant      | its limits                                                  |
|-------------|-------------------------------------------------------------|
| `unlimited` | none: the fast path, which never touches the store          |
| `limited`   | max_concurrent, requests_per_minute and tokens_per_minute   |
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from narwhal.config.tenants import TenantConfig
from narwhal.tenants.limits import TenantLimits
from narwhal.tenants.store import LimitStore, LocalStore, SharedStore, limits_path

TENANTS = [
    TenantConfig(name="unlimited"),
    TenantConfig(
        name="limited",
        max_concurrent=1_000_000,
        requests_per_minute=1e12,
        tokens_per_minute=1e15,
    ),
]
ROUNDS = 5


def admit_release(limits: TenantLimits, tenant: str, calls: int) -> float:
    """Seconds for `calls` admissions and releases."""
    now = 1000.0
    started = time.perf_counter()
    for _ in range(calls):
        now += 1e-4
        limits.release(limits.admit(tenant, 100, now), now)
    return time.perf_counter() - started


def whole_request(limits: TenantLimits, tenant: str, calls: int) -> float:
    """Seconds for `calls` requests as the router makes them: admit, headers, settle, release."""
    now = 1000.0
    started = time.perf_counter()
    for _ in range(calls):
        now += 1e-4
        ticket = limits.admit(tenant, 100, now)
        limits.headers(tenant, now)
        limits.settle(ticket, 80, now)
        limits.release(ticket, now)
    return time.perf_counter() - started


@contextlib.contextmanager
def stores() -> Iterator[list[tuple[str, LimitStore]]]:
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="narwhal-bench-", dir=memory) as run_dir:
        shared = SharedStore(limits_path(Path(run_dir)), 4, 0)
        try:
            where = "tmpfs" if memory else "disk"
            yield [("LocalStore", LocalStore()), (f"SharedStore ({where}, 4 workers)", shared)]
        finally:
            shared.close()


def best(
    measure: Callable[[TenantLimits, str, int], float],
    limits: TenantLimits,
    tenant: str,
    calls: int,
) -> float:
    """Microseconds per call, the best round."""
    return min(measure(limits, tenant, calls) for _ in range(ROUNDS)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    print(f"{'store':<32} {'tenant':<10} {'admit+release':>14} {'whole request':>14}")
    with stores() as made:
        for label, store in made:
            limits = TenantLimits(TENANTS, store)
            for config in TENANTS:
                pair = best(admit_release, limits, config.name, args.calls)
                whole = best(whole_request, limits, config.name, args.calls)
                print(f"{label:<32} {config.name:<10} {pair:>11.2f} µs {whole:>11.2f} µs")


if __name__ == "__main__":
    main()
