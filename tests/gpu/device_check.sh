#!/usr/bin/env bash
# The one offline command that proves the GPU path on a lent device (an H200: no network, the
# image's python3 with torch and Triton), run from the checkout with .device-carry/ beside it
# (`make device-carry`): bash tests/gpu/device_check.sh. Installs nothing from a network.
#
# Stages, most important first, each with its own time limit and exit code (it goes on after a
# failure): versions, kernels (every Triton kernel against its torch twin, compiled, in parallel
# workers), engine (token-exact against Transformers in float32, both attention backends agree),
# graphs (CUDA-graph replay against eager at -O0 and -O3), staging (the pinned staging race),
# bandwidth (paged decode against the device's copy bandwidth), throughput (bench throughput
# at 1, 32 and 256 requests against Transformers' static batch).
# Writes to $OUT (default device-check/): summary.txt (stage, exit code, seconds, key figure),
# junit.xml, results.json, log.txt, each rewritten after every stage. Exits non-zero when any
# stage failed.
#   DRY_RUN=1       the same stages on the CPU: Triton interpreted, small shapes, a few tests each
#   FAIL_STAGE=S    stage S fails (exit 97 after its command), for the test of the exit status
#   STAGES=a,b      only these stages
#   PYTHON          the interpreter (default python3); WHEELS the wheels to install (default
#                   .device-carry/wheels: those whose tags this interpreter takes)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
out=${OUT:-$root/device-check}
python=${PYTHON:-python3}
dry=${DRY_RUN:-0}
carry=${DEVICE_CARRY:-$root/.device-carry}
wheels=${WHEELS:-$carry/wheels}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")
: >"$out/summary.txt"
exec > >(tee "$out/log.txt") 2>&1

# llmrpc from this checkout, the carried wheels, nothing else: no PYTHONPATH from outside.
site=$work/site
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$wheels"/*.whl
fi
"$python" tests/gpu/link_checkout.py "$work/checkout" >/dev/null
export PYTHONPATH="$work/checkout:$site"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LLMRPC_CACHE_DIR=$work/cache TRITON_CACHE_DIR=$work/cache/triton
if [ "$dry" = 1 ]; then
  export LLMRPC_DEVICE_DRY_RUN=1 TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=
  small=--small
  device=cpu
  kernel_tests=(-m "not gpu")  # interpreted
  workers=0
  graph_tests=(tests/engine/test_cuda_graphs.py)  # the stand-in capture
  sample=(-p device_sample)  # the first tests of each file
else
  small=
  device=cuda
  kernel_tests=(-m gpu)
  workers=8
  graph_tests=(tests/engine/test_cuda_graphs_gpu.py)
  sample=()
fi
export LLMRPC_DEVICE_SAMPLE=${LLMRPC_DEVICE_SAMPLE:-2}
# the carried config and tokenizer with seeded random weights (SmolLM2-shaped; small when dry)
model=$work/model
"$python" tests/gpu/stand_in_model.py build "$carry/model" "$model" $small >/dev/null
export LLMRPC_TEST_MODEL_DIR=$model

status=0
stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 rc=0 started
  shift 2
  if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then return 0; fi
  echo "=== stage $name (limit ${limit}s)"
  started=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  if [ "${FAIL_STAGE:-}" = "$name" ] && [ "$rc" = 0 ]; then
    echo "FAIL_STAGE=$name: failing this stage on purpose"
    rc=97
  fi
  local seconds=$(($(date +%s) - started))
  [ "$rc" = 0 ] || status=1
  printf '%-11s rc=%-4s %5ss  %s\n' "$name" "$rc" "$seconds" \
    "$("$python" tests/gpu/collect.py figure "$name" "$work" 2>&1 | tail -1)" >>"$out/summary.txt"
  "$python" tests/gpu/collect.py merge "$work" "$out" || status=1
}
pytest_stage() {  # pytest_stage NAME LIMIT_S ARGS...
  local name=$1 limit=$2
  shift 2
  stage "$name" "$limit" "$python" -m pytest -q -p no:cacheprovider -p no:randomly \
    -o addopts= --junitxml="$work/$name.xml" --rootdir="$root" "${sample[@]}" "$@"
}
throughput() {
  local n
  for n in $([ "$dry" = 1 ] && echo "1 4 8" || echo "1 32 256"); do
    "$python" -m llmrpc.cli bench throughput --model "$model" --device "$device" \
      --dtype "$([ "$dry" = 1 ] && echo float32 || echo bfloat16)" --num-prompts "$n" \
      --input-len "$([ "$dry" = 1 ] && echo 16 || echo 128)" \
      --output-len "$([ "$dry" = 1 ] && echo 8 || echo 128)" \
      --baseline transformers --output-json "$work/throughput-$n.out" || return $?
  done
  "$python" -c "import json, sys, pathlib; w = pathlib.Path(sys.argv[1]); json.dump(
    {p.stem.split('-')[1]: json.loads(p.read_text()) for p in w.glob('throughput-*.out')},
    open(w / 'throughput.json', 'w'), indent=2)" "$work"
}

export PYTHONPATH="$PYTHONPATH:$root/tests/gpu"  # the device_sample plugin
# The limits add up to 510 s: with the set-up before them, the whole check ends within 9 minutes
# of device time whatever hangs (tests/gpu/test_device_check.py holds them to that).
stage versions 30 "$python" tests/gpu/device_info.py "$work/versions.json"
pytest_stage kernels 130 -n "$workers" "${kernel_tests[@]}" tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_elementwise.py tests/kernels/test_triton_lora.py \
  tests/kernels/test_triton_ops.py tests/kernels/test_triton_sampling.py tests/kernels/test_moe.py
pytest_stage engine 80 tests/engine/test_gpu_engine.py
pytest_stage graphs 75 "${graph_tests[@]}"
pytest_stage staging 45 tests/engine/test_staging_race_gpu.py
stage bandwidth 40 "$python" tests/gpu/decode_bandwidth.py --json "$work/bandwidth.json" $small
export dry device model work python
export -f throughput
stage throughput 110 bash -c throughput
cat "$out/summary.txt"
rm -rf "$work"
exit "$status"
