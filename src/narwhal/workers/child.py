"""One worker process: a full router on the shared port, answering its peers too.

Started by the supervisor (`python -m narwhal.workers.child ...`), never by hand. It reads
the same config file, binds the port with SO_REUSEPORT, and serves until SIGTERM (drain,
as a single router does) or until its supervisor is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from narwhal.app.process import Hooks
from narwhal.app.server import RouterServer, reload_signal, stop_signal
from narwhal.config.root import ConfigError, load_config
from narwhal.config.secrets import SecretsError, load_secrets
from narwhal.fleet.seat_share import SeatShare
from narwhal.observe.events import configure_logging
from narwhal.runtime import main as runtime
from narwhal.tenants.store import SharedStore, limits_path
from narwhal.workers.fanout import fan_out
from narwhal.workers.ledger import Ledger, ledger_path
from narwhal.workers.listener import shared_listener
from narwhal.workers.peers import Peers
from narwhal.workers.status import metrics_snapshot, peer_socket

# How often a worker checks that its supervisor still lives.
ORPHAN_CHECK_S = 1.0
# How often a worker writes its metrics where the supervisor keeps them if it dies: the
# counts a killed worker takes with it are at most this old.
SNAPSHOT_S = 1.0


def main(argv: list[str] | None = None) -> None:
    """The worker's command line, as the supervisor writes it."""
    parser = argparse.ArgumentParser(prog="narwhal-worker")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--worker", required=True, type=int)
    parser.add_argument("--workers", required=True, type=int)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    configure_logging(args.log_format)
    _name_worker_in_logs(args.worker)
    sys.exit(
        runtime.run(
            run_worker(args.config, args.host, args.port, args.worker, args.workers, args.run_dir),
            server=True,
        )
    )


async def run_worker(
    path: Path, host: str, port: int, worker: int, count: int, run_dir: Path
) -> int:
    """Serve as worker `worker` of `count` until SIGTERM; the exit status."""
    try:
        config = load_config(path)
        secrets = load_secrets(config)
    except (ConfigError, SecretsError) as error:
        print(f"worker {worker}: {path}: {error}", file=sys.stderr)
        return 2
    stopping = stop_signal()
    peers = Peers(run_dir, count, worker)
    ledger = Ledger(ledger_path(run_dir, worker))
    # Tenants' limits hold for the whole router: every worker keeps them in one file.
    limits = SharedStore(limits_path(run_dir), count, worker) if config.tenants else None
    server = RouterServer(
        config,
        host,
        port,
        secrets=secrets,
        config_path=path,
        listener=shared_listener(host, port),
        peer_path=str(peer_socket(run_dir, worker)),
        middlewares=[fan_out(peers)],
        journal_stamp={"worker": worker},
        seat_share=SeatShare(config.server.replicas, count, worker),
        hooks=Hooks(arrival=[ledger.opened], ended=[ledger.closed]),
        limit_store=limits,
    )
    reload_signal(server)
    await server.start()
    spawn = server.router.background.spawn
    spawn(_orphaned(stopping), "orphan-watch")
    spawn(_snapshots(server, metrics_snapshot(run_dir, worker)), "metrics-snapshots")
    try:
        await stopping.wait()
    finally:
        await server.shutdown(config.server.graceful_timeout_s)
        await peers.close()
        ledger.close()
        if limits is not None:
            limits.close()
    return 0


async def _orphaned(stopping: asyncio.Event) -> None:
    """Drain and stop once the supervisor is gone (killed), rather than hold the port."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(ORPHAN_CHECK_S)
        if os.getppid() != parent:
            break
    logging.getLogger("narwhal.workers").warning("supervisor %d is gone; stopping", parent)
    stopping.set()


async def _snapshots(server: RouterServer, path: Path) -> None:
    """Write this worker's own metrics every `SNAPSHOT_S`, replacing the last by rename."""
    fresh = path.with_suffix(".new")
    while True:
        await asyncio.sleep(SNAPSHOT_S)
        body, _ = server.router.metrics.render(None)
        fresh.write_bytes(body)
        os.replace(fresh, path)


def _name_worker_in_logs(worker: int) -> None:
    """Each log line says which worker wrote it (a `worker` field in JSON lines)."""

    def stamp(record: logging.LogRecord) -> bool:
        fields = getattr(record, "fields", None)
        record.fields = {**(fields if isinstance(fields, dict) else {}), "worker": worker}
        record.worker = worker
        return True

    for handler in logging.getLogger("narwhal").handlers:
        handler.addFilter(stamp)
        if type(handler.formatter) is logging.Formatter:  # the text format (JSON has the field)
            handler.setFormatter(
                logging.Formatter(
                    "%(asctime)s %(levelname)s %(name)s [worker %(worker)d]: %(message)s"
                )
            )


if __name__ == "__main__":
    main()
