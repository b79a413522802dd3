"""`narwhal dev`: a local fleet plus the router.

By default the fleet is simulated (two prefill, two decode engines). With `--engine vllm`
it is one prefill and one decode real vLLM engine on the CPU, serving the tiny model that
`make tiny-model` builds: each engine is bound to one core, so two is what a 2-core machine
holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from narwhal.app.server import RouterServer, stop_signal
from narwhal.config.root import Config, parse_config
from narwhal.tools.sim.fleet import SimFleet
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.vllm_fleet import VllmFleet, VllmOptions

DEV_MODEL = "narwhal-sim"
VLLM_MODEL = "narwhal-tiny"
VLLM_ENGINES = (("prefill-0", "prefill"), ("decode-0", "decode"))


DEV_ENGINES = (
    ("prefill-0", "prefill"),
    ("prefill-1", "prefill"),
    ("decode-0", "decode"),
    ("decode-1", "decode"),
)


def banner(url: str, model: str, kind: str, engines: Sequence[tuple[str, str]], tail: str) -> str:
    """Where everything is, and requests to paste; `tail` is what only this fleet offers."""
    listing = "\n".join(f"  {name:<10} {engine_url}" for name, engine_url in engines)
    return f"""\
Narwhal router on {url}, model "{model}", over a {kind}:
{listing}

Try it:
  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "The sea is", "max_tokens": 16}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{url}/v1", api_key="none")
for chunk in c.chat.completions.create(model="{model}", stream=True,
        messages=[{{"role": "user", "content": "Hello"}}], max_tokens=32):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()'

{tail}
Ctrl-C stops everything.
"""


async def run_dev(host: str, port: int, journal: str | None, engine: str = "sim") -> int:
    if engine == "vllm":
        return await _run_vllm(host, port, journal)
    options = [
        SimOptions(name=name, host=host, port=0, faults_enabled=True) for name, _ in DEV_ENGINES
    ]
    async with SimFleet(options) as fleet:
        engines = [
            (name, role, e.url) for (name, role), e in zip(DEV_ENGINES, fleet.engines, strict=True)
        ]
        tail = f"""\
Rehearse a failure (engines run with faults enabled):
  curl -s -X POST {fleet.engines[2].url}/sim/faults -d '{{"status": 503, "times": 1}}'
"""
        config = _config(host, port, journal, DEV_MODEL, engines, {})
        return await _serve(config, "simulated fleet", engines, tail)


async def _run_vllm(host: str, port: int, journal: str | None) -> int:
    root = _checkout()
    if root is None:
        print("narwhal dev --engine vllm: needs a source checkout (Makefile, tools/)", flush=True)
        return 2
    print("Installing vLLM (.venv-vllm) and building the tiny model, unless done", flush=True)
    make = await asyncio.create_subprocess_exec("make", "-s", "-C", str(root), "tiny-model")
    if await make.wait() != 0:
        print("narwhal dev --engine vllm: `make tiny-model` failed", flush=True)
        return 1
    options = VllmOptions(
        python=root / ".venv-vllm" / "bin" / "python",
        model=root / ".cache" / "tiny-model",
        served_model_name=VLLM_MODEL,
        log_dir=root / ".cache" / "dev-vllm-logs",
        extra_args=("--reasoning-parser", "deepseek_r1"),
    )
    print(f"Starting {len(VLLM_ENGINES)} vLLM engines, about a minute", flush=True)
    async with VllmFleet(options, VLLM_ENGINES) as fleet:
        engines = [(e.name, e.role, e.url) for e in fleet]
        tail = f"""\
Each engine is a vLLM server on one CPU core; the model is a 2-layer Llama trained for
seconds on a few sentences, so it answers with them, and chat answers stream their
reasoning (delta.reasoning) before the content. Engine logs: {options.log_dir}
"""
        # A CPU engine's first decode also sets up its NIXL connection to the producer.
        config = _config(host, port, journal, VLLM_MODEL, engines, {"first_token_timeout_s": 30.0})
        return await _serve(config, "real vLLM fleet", engines, tail)


def _checkout() -> Path | None:
    """The source tree this package runs from (an editable install), which can build vLLM."""
    root = Path(__file__).resolve().parents[3]
    needed = (root / "Makefile", root / "tools" / "tiny_model.py")
    return root if all(path.exists() for path in needed) else None


def _config(
    host: str,
    port: int,
    journal: str | None,
    model: str,
    engines: Sequence[tuple[str, str, str]],
    engine_section: dict[str, float],
) -> Config:
    """The router's configuration for (name, role, url) engines."""
    return parse_config(
        {
            "model": model,
            "server": {"host": host, "port": port},
            "journal": {"path": journal} if journal else {},
            "engine": engine_section,
            "engines": [{"id": name, "url": url, "role": role} for name, role, url in engines],
        },
        source="narwhal dev",
    )


async def _serve(
    config: Config, kind: str, engines: Sequence[tuple[str, str, str]], tail: str
) -> int:
    stopping = stop_signal()
    server = RouterServer(config)
    await server.start()
    listing = [(name, url) for name, _, url in engines]
    print(banner(server.url, config.model, kind, listing, tail), flush=True)
    try:
        await stopping.wait()
    finally:
        await server.shutdown(config.server.graceful_timeout_s)
    return 0
