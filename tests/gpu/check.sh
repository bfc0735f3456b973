#!/usr/bin/env bash
# The GPU checks of the engine, in one run on a machine with a CUDA device (`make gpu-check`):
# the tests marked gpu, the engine's throughput on SmolLM2 in bfloat16 against Transformers'
# static batch on the same GPU at 1, 32 and 256 requests, and the paged decode kernel's
# bandwidth against the device's copy bandwidth. Output goes to stdout and, one file a part,
# to ${OUT:-gpu-check}/.
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
python=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
PYTHONUNBUFFERED=1 $python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.txt"
for n in 1 32 256; do
  PYTHONUNBUFFERED=1 $python -m llmrpc.cli bench throughput --device cuda --dtype bfloat16 \
    --num-prompts "$n" --input-len 128 --output-len 128 --baseline transformers --repeats 2 \
    --output-json "$out/throughput-$n.json" 2>&1 | tee "$out/throughput-$n.txt"
done
PYTHONUNBUFFERED=1 $python tests/gpu/decode_bandwidth.py 2>&1 | tee "$out/decode-bandwidth.txt"
