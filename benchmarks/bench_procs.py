"""The benchmark's processes: starting and stopping them, and reading their CPU and memory
from the OS (/proc), never estimating them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
LOAD_SCRIPT = HERE / "bench_load.py"
BENCH_VENV = HERE.parent / ".venv-bench"
BENCH_VENV_ROUTER = BENCH_VENV / "bin" / "vllm-router"
FASTAPI_PROXY = HERE / "peers" / "fastapi_proxy.py"
FASTAPI_PROXY_NEEDS = ("fastapi", "httpx", "uvicorn", "uvloop", "httptools")
"""What the FastAPI peer imports; `make bench-setup` installs them in .venv-bench."""
MODEL = "narwhal-sim"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
START_TIMEOUT_S = 60.0
ANSWER_LIMIT = 256 * 2**20
"""Longest answer line from a load process: it carries every request's latencies."""


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls, name: str, argv: Sequence[str], workdir: Path, *, stdin: bool = False
    ) -> Proc:
        log = workdir / f"{name}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if stdin else out,
                stderr=out,
                limit=ANSWER_LIMIT,
            )
        return cls(name, process, log)

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.process.returncode is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}; its log ends:\n{self.tail()}"
            )

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10.0)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


class LoadProcess:
    """A `bench_load.py` process: one JSON job per line in, one JSON answer per line out."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    async def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        await self.send(job)
        return await self.answer()

    async def send(self, job: dict[str, Any]) -> None:
        stdin = self.proc.process.stdin
        assert stdin is not None
        stdin.write(orjson.dumps(job) + b"\n")
        await stdin.drain()

    async def answer(self) -> dict[str, Any]:
        stdout = self.proc.process.stdout
        assert stdout is not None
        line = await stdout.readline()
        if not line:
            self.proc.check_alive()
            raise RuntimeError(f"{self.proc.name} closed its output; log:\n{self.proc.tail()}")
        answer: dict[str, Any] = orjson.loads(line)
        return answer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def raise_open_files_limit() -> int:
    """Lift the soft open-files limit to the hard one (children inherit it); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# --- Reading the OS -----------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """The process and every process below it (a router may run workers)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(entry.path, "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process and its descendants, from /proc/<pid>/stat."""
    total = 0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants, from /proc/<pid>/statm."""
    total = 0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * PAGE_SIZE
    return total
