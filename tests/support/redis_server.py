"""A real redis-server of this machine for the tests: started on a free port of 127.0.0.1
(or on a port given, to bring a stopped server back where its clients look for it), with no
persistence, and stopped at the end."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# A shared machine may be slow to start a process: this is a bound, not an expectation.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    """A running redis-server and the port it listens on."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL if it will not) and wait for it to exit."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def redis_executable() -> str:
    """Debian's redis-server on PATH; the test is skipped where there is none."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("no redis-server on PATH (make test installs Debian's with apt-get)")
    return executable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(directory: Path, port: int | None = None) -> RedisServer:
    """A redis-server that answers PING, its files (the log) in `directory`. On `port` when
    given; otherwise on a free port, another one if the one chosen was taken before the
    server bound it."""
    executable = redis_executable()
    attempts = 1 if port is not None else 3
    log = directory / "redis.log"
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        log = directory / f"redis-{chosen}-{attempt}.log"
        argv = [
            *(executable, "--port", str(chosen), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", str(directory)),
            *("--logfile", str(log)),
        ]
        server = RedisServer(
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL), chosen
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while server.process.poll() is None and time.monotonic() < deadline:
            if answers_ping(chosen):
                return server
            time.sleep(0.05)
        server.stop()
    text = log.read_text()[-2000:] if log.exists() else "(none)"
    raise RuntimeError(f"redis-server did not start; its log: {text}")
