"""`narwhal dev`: a local simulated fleet (two prefill, two decode engines) plus the router."""

from __future__ import annotations

from narwhal.config import parse_config
from narwhal.router.app import RouterServer, stop_signal
from narwhal.sim.fleet import SimFleet
from narwhal.sim.options import SimOptions

DEV_MODEL = "narwhal-sim"


DEV_ENGINES = (
    ("prefill-0", "prefill"),
    ("prefill-1", "prefill"),
    ("decode-0", "decode"),
    ("decode-1", "decode"),
)


def banner(url: str, fleet: SimFleet) -> str:
    engines = "\n".join(f"  {e.options.name:<10} {e.url}" for e in fleet.engines)
    return f"""\
Narwhal router on {url}, model "{DEV_MODEL}", over a simulated fleet:
{engines}

Try it:
  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{DEV_MODEL}", "prompt": "The sea is", "max_tokens": 16}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{url}/v1", api_key="none")
for chunk in c.chat.completions.create(model="{DEV_MODEL}", stream=True,
        messages=[{{"role": "user", "content": "Hello"}}], max_tokens=32):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()'

Rehearse a failure (engines run with faults enabled):
  curl -s -X POST {fleet.engines[2].url}/sim/faults -d '{{"status": 503, "times": 1}}'

Ctrl-C stops everything.
"""


async def run_dev(host: str, port: int, journal: str | None) -> int:
    options = [
        SimOptions(name=name, host=host, port=0, faults_enabled=True) for name, _ in DEV_ENGINES
    ]
    async with SimFleet(options) as fleet:
        config = parse_config(
            {
                "model": DEV_MODEL,
                "server": {"host": host, "port": port},
                "journal": {"path": journal} if journal else {},
                "engines": [
                    {"id": name, "url": engine.url, "role": role}
                    for (name, role), engine in zip(DEV_ENGINES, fleet.engines, strict=True)
                ],
            },
            source="narwhal dev",
        )
        stopping = stop_signal()
        server = RouterServer(config)
        await server.start()
        print(banner(server.url, fleet), flush=True)
        try:
            await stopping.wait()
        finally:
            await server.shutdown(config.server.graceful_timeout_s)
    return 0
