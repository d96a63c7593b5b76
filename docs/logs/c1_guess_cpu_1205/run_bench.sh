#!/bin/bash
# $1: comma list of sets, one at a time. OUT: where the outputs go (default /tmp/c1e; copied into bench/ beside this
# script after the run). PATH_FLAG: --fast-path (default: the engine path) or empty (off CUDA, the eager loop, as
# docs/logs/c1_tau_cpu_1205/bench/run.sh ran).
cd /work/main
OUT=${OUT:-/tmp/c1e}
PATH_FLAG=${PATH_FLAG---fast-path}
mkdir -p "$OUT"
IFS=, read -r -a SETS <<< "$1"
for s in "${SETS[@]}"; do
  n=$(echo "$s" | tr ':' '_')
  ADAFLASH_DATA=/work/shared/data OMP_NUM_THREADS=1 python3 -m adaflash_hf.bench --reference --max-new-tokens 128 --dtype fp32 \
    --length-rate 2 --no-plots --quiet --datasets "$s" --split test --num-prompts 500 --concurrency 1 --warmup 0 \
    --methods plain,fixed,cost --device cpu $PATH_FLAG --out "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "$s done rc=$? $(date -u +%T)" >> "$OUT/progress.txt"
done
