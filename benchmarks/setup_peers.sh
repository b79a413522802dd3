#!/usr/bin/env bash
# Peer routers and the profiler for the router benchmark, in a venv of their own so that
# they never become Narwhal's dependencies. router_bench.py finds .venv-bench/bin/vllm-router,
# and runs benchmarks/peers/fastapi_proxy.py with .venv-bench/bin/python when it has FastAPI.
#
#   bash benchmarks/setup_peers.sh [VENV]      (default: .venv-bench beside benchmarks/)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-bench}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q vllm-router py-spy
# The FastAPI peer: uvicorn[standard] brings uvloop and httptools. httpcore looks for sniffio
# on every request and, without it, pays a failed import each time; recent anyio no longer
# installs it, so it is asked for here.
"$venv/bin/python" -m pip install -q fastapi 'uvicorn[standard]' httpx sniffio
"$venv/bin/vllm-router" --help >/dev/null
"$venv/bin/python" benchmarks/peers/fastapi_proxy.py --help >/dev/null
echo "peers installed in $venv: $("$venv/bin/python" -m pip show vllm-router | grep -i '^version')"
echo "  fastapi $("$venv/bin/python" -c 'import fastapi; print(fastapi.__version__)')," \
    "httpx $("$venv/bin/python" -c 'import httpx; print(httpx.__version__)')"
