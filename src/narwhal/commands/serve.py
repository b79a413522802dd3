"""`narwhal serve`: load and validate the fleet config, then serve until a signal.

SIGTERM and SIGINT drain and stop; SIGHUP re-reads the config file and applies its engine
list (`fleet.operations`); `narwhal reload` asks for the same over the admin API.
"""

from __future__ import annotations

import sys
from pathlib import Path

from narwhal.app.server import RouterServer, reload_signal, stop_signal
from narwhal.config.root import ConfigError, load_config
from narwhal.config.secrets import SecretsError, load_secrets
from narwhal.config.workers import Workers, conflict, resolve_workers
from narwhal.fleet.preflight import format_report, run_preflight


async def run_serve(
    path: Path,
    host: str | None,
    port: int | None,
    *,
    skip_preflight: bool = False,
    workers: Workers | None = None,
    log_format: str = "text",
) -> int:
    """`workers`: the `--workers` flag, over `server.workers`; more than one runs a
    supervisor and that many router processes on the port (`narwhal.workers`)."""
    try:
        config = load_config(path)
    except ConfigError as error:
        print(error.report(), file=sys.stderr)
        return 2
    try:
        secrets = load_secrets(config)
    except SecretsError as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 2
    if not skip_preflight:
        rows = await run_preflight(config, secrets)
        if not all(row.ok for row in rows):
            print(format_report(rows), file=sys.stderr)
            print("preflight failed; not serving (--skip-preflight overrides)", file=sys.stderr)
            return 1
    count = resolve_workers(workers if workers is not None else config.server.workers)
    problem = conflict(count, config.controller.enabled)
    if problem is not None:
        print(f"{path}: {problem}", file=sys.stderr)
        return 2
    if count > 1:
        from narwhal.workers.supervisor import run_supervised

        return await run_supervised(
            config,
            path,
            host if host is not None else config.server.host,
            port if port is not None else config.server.port,
            count,
            log_format,
        )
    stopping = stop_signal()
    server = RouterServer(config, host, port, secrets=secrets, config_path=path)
    reload_signal(server)
    await server.start()
    print(
        f"narwhal serving {config.model} on {server.url} over {len(config.engines)} engines",
        flush=True,
    )
    try:
        await stopping.wait()
    finally:
        await server.shutdown(config.server.graceful_timeout_s)
    return 0
