#!/usr/bin/env bash
# One device call's worth of GPU checks and timings, each step under its own time limit inside a total
# budget (a device call may run 600 s), logs and JSON rows under $OUT (the device tool brings them back).
# Why: GPU time comes in 30-minute sessions and a machine idles out 30 s after a call, so a session's
# GPU work is two or three of these calls, each ending with a summary table, not many small ones.
#
#   bash benchmarks/gpu_session.sh kernels    # -m gpu tests + self-tests of every CUDA kernel
#   bash benchmarks/gpu_session.sh timings    # decode_kernels.py rows (MoE, indexer, attention, GEMV)
#   bash benchmarks/gpu_session.sh engine     # engine_gpu.py: small and M3.1-width rows, LoRA rows
#   bash benchmarks/gpu_session.sh small_base # the gpu_small recipe's warm-up (then: python -m rl.train
#                                             # recipe=gpu_small in the next call, while the machine is warm)
# Every step's exit code and time go to $OUT/summary.txt; a step cut by its limit says rc=124.
set -u
OUT="${OUT:-/tmp/gpu_session}"
BUDGET="${BUDGET:-570}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

step() {  # step NAME LIMIT_S CMD...: runs CMD with the smaller of LIMIT_S and the budget left
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then echo "$name skipped (budget)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 12 "$OUT/$name.log"
}

GPU_TESTS=(python -m pytest -q -m gpu -p no:cacheprovider)  # `timeout` runs commands, not shell functions

case "${1:-kernels}" in
  kernels)
    step moe_tests 180 "${GPU_TESTS[@]}" tests/model/test_cuda_moe.py
    step moe_selftest 60 python -m model.kernels.cuda_moe --selftest
    step indexer_tests 120 "${GPU_TESTS[@]}" tests/model/test_cuda_indexer.py
    step attention_tests 200 "${GPU_TESTS[@]}" tests/model/test_cuda_attention.py
    step attention_selftest 90 python -m model.kernels.cuda_attention --selftest
    step gemv_tests 200 "${GPU_TESTS[@]}" tests/model/test_cuda_gemv.py
    step gemv_selftest 60 python -m model.kernels.cuda_gemv --selftest --rows 1 4 8 16 32 64
    ;;
  timings)
    step dk_attention 150 python benchmarks/decode_kernels.py --device cuda --only attention \
      --contexts 131072 --batches 64 1 --variants v6 v7 --json "$OUT/decode_attention.jsonl"
    step dk_gemv 120 python benchmarks/decode_kernels.py --device cuda --only gemv --variants v3 v7 \
      --json "$OUT/decode_gemv.jsonl"
    step dk_moe 150 python benchmarks/decode_kernels.py --device cuda --only moe --variants v2 v7 \
      --json "$OUT/decode_moe.jsonl"
    step dk_indexer 120 python benchmarks/decode_kernels.py --device cuda --only indexer \
      --contexts 131072 --batches 64 1 --json "$OUT/decode_indexer.jsonl"
    ;;
  engine)
    step graphs_tests 200 "${GPU_TESTS[@]}" tests/rollout/test_cuda_graphs.py tests/model/test_kernel_groups.py
    step engine_m3 160 python benchmarks/engine_gpu.py --configs m3.1-flash:64 m3.1-flash:8 --modes graphs \
      --no-peer --repeats 2 --short 16 --long 48 --json "$OUT/engine_m3.jsonl"
    step engine_small 240 python benchmarks/engine_gpu.py --configs small:64 small:8 small:1 small:256 \
      --modes graphs --repeats 2 --short 16 --long 48 --json "$OUT/engine_small.jsonl"
    step engine_lora 150 python benchmarks/engine_gpu.py --configs small:64 small:8 --modes graphs --lora 32 \
      --no-peer --repeats 2 --short 16 --long 48 --json "$OUT/engine_lora.jsonl"
    ;;
  small_base)
    # The site packages rl.train and the scorer need (ray, verl, wandb, ...): benchmarks/gpu_site.sh.
    [ -f .gpu/site.tar.xz ] && mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    step small_warmup 560 python -u -m rollout.bases.warmup --preset small --device cuda \
      --out runs/_cache/small-base ${WARMUP_ARGS:---lr 1e-3 --lr-warmup 50 --batch-size 256 --eval-every 100}
    ;;
  *) echo "unknown phase $1 (kernels, timings, engine, small_base)"; exit 2 ;;
esac
echo "total $((SECONDS - START)) s"; cat "$OUT/summary.txt"
