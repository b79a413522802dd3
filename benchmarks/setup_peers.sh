#!/usr/bin/env bash
# Peer routers and the profiler for the router benchmark, in a venv of their own so that
# they never become Narwhal's dependencies. router_bench.py finds .venv-bench/bin/vllm-router.
#
#   bash benchmarks/setup_peers.sh [VENV]      (default: .venv-bench beside benchmarks/)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-bench}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q vllm-router py-spy
"$venv/bin/vllm-router" --help >/dev/null
echo "peers installed in $venv: $("$venv/bin/python" -m pip show vllm-router | grep -i '^version')"
