"""The supervisor of `narwhal serve --workers N`: starts N workers, replaces any that exits,
forwards SIGHUP, and on SIGTERM (or SIGINT) has every worker drain, then exits.

It serves no request itself. It holds the port (a bound, never-listening SO_REUSEPORT
socket, see `listener`), a run directory for the workers' Unix sockets and its status file
(`status`), and journals each worker's exit and replacement as a `worker` line.

A worker that exits while the router is not stopping is replaced at once; one that keeps
dying within `QUICK_EXIT_S` of its start is replaced after a delay doubling up to
`MAX_BACKOFF_S`, so a worker that cannot start does not spin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from narwhal.app.server import stop_signal
from narwhal.config.root import Config
from narwhal.observe.journal import Journal
from narwhal.workers.ledger import ledger_path, unfinished
from narwhal.workers.listener import shared_listener
from narwhal.workers.status import SlotStatus, peer_socket, retire_snapshot, write_status

log = logging.getLogger("narwhal.workers")
QUICK_EXIT_S = 5.0
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
# A worker must answer on its Unix socket within this of its start.
START_TIMEOUT_S = 60.0
# After the workers' own grace period: how long a draining worker may take to exit.
EXIT_MARGIN_S = 10.0


class Supervisor:
    """N worker slots, each kept filled until the router stops."""

    def __init__(
        self, config: Config, path: Path, host: str, port: int, count: int, log_format: str
    ) -> None:
        self.config = config
        self.path = path
        self.host = host
        self.count = count
        self.log_format = log_format
        self.run_dir = Path(tempfile.mkdtemp(prefix="narwhal-workers-", dir=_memory_dir()))
        self._holder = shared_listener(host, port)
        self.port: int = self._holder.getsockname()[1]
        self.slots = [SlotStatus(worker) for worker in range(count)]
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = asyncio.Event()
        self.journal = Journal(Path(config.journal.path) if config.journal.path else None)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def run(self) -> int:
        """Serve until SIGTERM or SIGINT; 1 if the workers could not all start."""
        self._stopping = stop_signal()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        self.journal.start()
        try:
            async with asyncio.TaskGroup() as group:
                for slot in self.slots:
                    await self._start(slot)
                if not await self._all_ready():
                    print("narwhal: the workers did not all start", file=sys.stderr)
                    self._stopping.set()
                    await self._stop_all()
                    return 1
                for slot in self.slots:
                    group.create_task(self._keep(slot))
                print(
                    f"narwhal serving {self.config.model} on {self.url} over "
                    f"{len(self.config.engines)} engines with {self.count} workers",
                    flush=True,
                )
                await self._stopping.wait()
                await self._stop_all()
            return 0
        finally:
            await self.journal.close()
            self._holder.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _start(self, slot: SlotStatus) -> None:
        peer_socket(self.run_dir, slot.worker).unlink(missing_ok=True)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "narwhal.workers.child",
            "--config",
            str(self.path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker",
            str(slot.worker),
            "--workers",
            str(self.count),
            "--run-dir",
            str(self.run_dir),
            "--log-format",
            self.log_format,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self._processes[slot.worker] = process
        slot.pid, slot.started = process.pid, time.time()
        self._write_status()

    async def _all_ready(self) -> bool:
        """Whether every worker opened its Unix socket (it serves from then on)."""
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            if any(p.returncode is not None for p in self._processes.values()):
                return False
            if all(peer_socket(self.run_dir, s.worker).exists() for s in self.slots):
                return True
            await asyncio.sleep(0.05)
        return False

    async def _keep(self, slot: SlotStatus) -> None:
        """Replace the slot's worker whenever it exits, until the router stops."""
        backoff = FIRST_BACKOFF_S
        while True:
            process = self._processes[slot.worker]
            code = await process.wait()
            if self._stopping.is_set():
                return
            lived = time.time() - (slot.started or 0.0)
            lost = self._record_lost(slot.worker, process.pid, code)
            retire_snapshot(self.run_dir, slot.worker, process.pid)
            slot.restarts += 1
            slot.last_exit = code
            slot.lost += len(lost)
            delay = backoff if lived < QUICK_EXIT_S else 0.0
            backoff = min(backoff * 2, MAX_BACKOFF_S) if lived < QUICK_EXIT_S else FIRST_BACKOFF_S
            log.warning(
                "worker %d (pid %d) exited (%s) after %.1f s serving %d requests; replacing it%s",
                slot.worker,
                process.pid,
                _exit_text(code),
                lived,
                len(lost),
                f" in {delay:g} s" if delay else "",
            )
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                if self._stopping.is_set():
                    return
            await self._start(slot)
            self.journal.record(
                {
                    "type": "worker",
                    "event": "replaced",
                    "worker": slot.worker,
                    "pid": process.pid,
                    "exit": _exit_text(code),
                    "lived_s": round(lived, 3),
                    "lost_requests": len(lost),
                    "new_pid": slot.pid,
                    "restarts": slot.restarts,
                }
            )

    def _record_lost(self, worker: int, pid: int, code: int) -> list[dict[str, Any]]:
        """A journal line for each request the exited worker was serving (its ledger)."""
        path = ledger_path(self.run_dir, worker)
        lost = unfinished(path)
        path.unlink(missing_ok=True)
        for entry in lost:
            self.journal.record(
                {
                    "type": "request",
                    "request_id": entry["open"],
                    "client_request_id": entry["client_request_id"],
                    "endpoint": entry["endpoint"],
                    "arrived": entry["ts"],
                    "status": None,
                    "outcome": "lost",
                    "cause": "worker_exited",
                    "error": f"worker {worker} (pid {pid}) exited ({_exit_text(code)}) "
                    "while serving it",
                    "worker": worker,
                }
            )
        return lost

    async def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains), then wait; SIGKILL past the grace."""
        self._forward(signal.SIGTERM)
        running = [p for p in self._processes.values() if p.returncode is None]
        grace = self.config.server.graceful_timeout_s + EXIT_MARGIN_S
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*(p.wait() for p in running))
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.warning(
                        "worker pid %d did not drain in %g s; killing it", process.pid, grace
                    )
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))

    def _forward(self, sig: signal.Signals) -> None:
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def _write_status(self) -> None:
        write_status(self.run_dir, os.getpid(), self.slots)


def _memory_dir() -> str | None:
    """tmpfs where there is one: the ledgers are written on every request."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _exit_text(code: int) -> str:
    if code < 0:
        return signal.Signals(-code).name
    return f"exit {code}"


async def run_supervised(
    config: Config, path: Path, host: str, port: int, count: int, log_format: str
) -> int:
    """`narwhal serve` with more than one worker."""
    return await Supervisor(config, path, host, port, count, log_format).run()
