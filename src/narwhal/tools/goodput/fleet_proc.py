"""A simulated fleet in a child process, so engines and the router + client use two cores.

    python -m narwhal.tools.goodput.fleet_proc COUNT OPTIONS_JSON

OPTIONS_JSON holds SimOptions fields (`profile` names a preset applied first). The child
prints one JSON line with the engine urls, then answers each `cpu` line on stdin with its
CPU seconds so far, and stops at end of input.
"""

from __future__ import annotations

import asyncio
import resource
import sys
from typing import Any

import orjson

from narwhal.runtime import main as runtime
from narwhal.tools.sim.fleet import SimFleet
from narwhal.tools.sim.options import profile_options


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _main(count: int, fields: dict[str, Any]) -> None:
    preset = fields.pop("profile", "dev")
    options = [profile_options(preset, **fields, name=f"engine-{i}", port=0) for i in range(count)]
    async with SimFleet(options) as fleet:
        print(orjson.dumps({"urls": [engine.url for engine in fleet]}).decode(), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.strip() == b"cpu":
                print(orjson.dumps({"cpu_s": cpu_seconds()}).decode(), flush=True)


def main(argv: list[str]) -> None:
    runtime.run(_main(int(argv[0]), orjson.loads(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
