"""CPU per non-streaming answer: the one typed pass against the member-by-member fold.

Both build the same answer from the same stream (the simulator's own chunks, as the router
receives them); the script checks that the bytes agree, then prints microseconds per
answer for each, and their ratio, per endpoint and length. Run it as

    .venv/bin/python benchmarks/assemble_bench.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import orjson

from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.sse import block_payloads
from narwhal.router.assemble import Assembler
from narwhal.router.assemble_typed import typed_answer
from narwhal.tools.sim.api import Route
from narwhal.tools.sim.responses import StreamEncoder, Usage


def stream_block(endpoint: Endpoint, tokens: int) -> tuple[bytes, dict[str, object]]:
    """A decode stream's forwarded events and the usage chunk the router holds back."""
    route: Route = "chat" if endpoint is Endpoint.CHAT else "completions"
    encoder = StreamEncoder(route, "cmpl-bench", 1_700_000_000, "narwhal-sim", fingerprint="fp")
    events = [encoder.role()] if endpoint is Endpoint.CHAT else []
    events += [encoder.token(f" w{index}") for index in range(tokens - 1)]
    events.append(encoder.last_token(" end", "length", None, with_fingerprint=False))
    usage = Usage(prompt_tokens=40, completion_tokens=tokens)
    usage_chunk = orjson.loads(encoder.usage(usage)[6:-2])
    return b"".join(events), usage_chunk


def general(endpoint: Endpoint, block: bytes, usage_chunk: dict[str, object]) -> bytes:
    assembler = Assembler(endpoint)
    for payload in block_payloads(block):
        assembler.add(payload)
    assembler.add(usage_chunk)
    return orjson.dumps(assembler.result())


def typed(endpoint: Endpoint, block: bytes, usage_chunk: dict[str, object]) -> bytes:
    answer = typed_answer(endpoint, block, usage_chunk, None)
    assert answer is not None, "the simulator's stream should take the typed pass"
    return answer[0]


Build = Callable[[Endpoint, bytes, dict[str, object]], bytes]


def cpu_us(
    build: Build, endpoint: Endpoint, block: bytes, usage_chunk: dict[str, object], repeat: int
) -> float:
    """Process CPU per answer, in microseconds, best of three rounds."""
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for _ in range(repeat):
            build(endpoint, block, usage_chunk)
        best = min(best, (time.process_time() - started) / repeat)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="answers per round")
    args = parser.parse_args()
    print(f"{'endpoint':<12}{'tokens':>8}{'fold µs':>10}{'typed µs':>10}{'typed/fold':>12}")
    for endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT):
        for tokens in (16, 64, 256, 1024):
            block, usage_chunk = stream_block(endpoint, tokens)
            assert general(endpoint, block, usage_chunk) == typed(endpoint, block, usage_chunk)
            fold = cpu_us(general, endpoint, block, usage_chunk, args.repeat)
            one = cpu_us(typed, endpoint, block, usage_chunk, args.repeat)
            name = "chat" if endpoint is Endpoint.CHAT else "completions"
            print(f"{name:<12}{tokens:>8}{fold:>10.1f}{one:>10.1f}{one / fold:>12.2f}")


if __name__ == "__main__":
    main()
