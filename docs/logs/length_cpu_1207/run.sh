#!/bin/bash
# Issue 52's CPU tau check on the engine path: fixed and cost (the default), every eval set's test slice, 128 new
# tokens, c=1, one set after another; plain's rows for the identity check decoded 64 prompts at a time. The same flags
# as ../c1_traffic_cpu_1205/run.sh, run from main. Usage: bash run.sh SET...   OUT: default bench/.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/logs/length_cpu_1207/bench}; PY=${PY:-python}
for s in "$@"; do n=$(echo "$s" | tr ':' '_')
  ADAFLASH_DATA=/work/shared/data OMP_NUM_THREADS=1 $PY -m adaflash_hf.bench --reference --max-new-tokens 128 \
    --dtype fp32 --length-rate 2 --no-plots --quiet --datasets "$s" --split test --num-prompts 500 --concurrency 1 \
    --warmup 0 --methods fixed,cost --reference-concurrency 64 --device cpu --fast-path --out "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "$s rc=$? $(date -u +%T)" >> "$OUT/progress.txt"
done
