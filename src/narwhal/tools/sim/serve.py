"""`narwhal sim`: run one engine until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from narwhal.runtime import main as runtime
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.lora import LoraRegistry
from narwhal.tools.sim.options import SimOptions, options_from_args

CRASH_EXIT_CODE = 70
"""Exit status of a process killed by the `crash` fault (EX_SOFTWARE)."""


def run_sim(args: argparse.Namespace) -> int:
    """Serve one simulated engine from parsed flags; returns the process exit status."""
    try:
        options = options_from_args(args)
        # A start-up adapter that does not load stops the engine, as it stops vLLM.
        LoraRegistry(options.model, options.lora_modules, check_paths=options.check_lora_paths)
    except ValueError as exc:
        print(f"narwhal sim: {exc}", file=sys.stderr)
        return 2
    runtime.run(_serve(options))
    return 0


async def _serve(options: SimOptions) -> None:
    engine = SimEngine(options, on_crash=lambda: os._exit(CRASH_EXIT_CODE))
    await engine.start()
    print(
        f"narwhal sim {options.name} listening on {engine.url} "
        f"(side channel {options.resolved_side_channel_host}:{engine.side_channel_port})",
        flush=True,
    )
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopped.set)
    try:
        await stopped.wait()
    finally:
        await engine.stop()
