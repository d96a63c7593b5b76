#!/bin/bash
# Issue 35's c=1 tau goal on the engine path (dev CPU): fixed and cost (the default), test slices, 128 new tokens, the
# sets given one after another; plain's rows for the identity check decoded 64 prompts at a time (--reference-concurrency).
# Two queues ran side by side: `bash run.sh spec_bench:translation prose mt_bench spec_bench:math_reasoning math500` and
# `bash run.sh spec_bench:qa sharegpt codealpaca` (summarization and RAG before them, the same command). OUT: default bench/.
cd /work/main
OUT=${OUT:-docs/logs/c1_traffic_cpu_1205/bench}
for s in "$@"; do n=$(echo "$s" | tr ':' '_')
  ADAFLASH_DATA=/work/shared/data OMP_NUM_THREADS=1 python -m adaflash_hf.bench --reference --max-new-tokens 128 \
    --dtype fp32 --length-rate 2 --no-plots --quiet --datasets "$s" --split test --num-prompts 500 --concurrency 1 \
    --warmup 0 --methods fixed,cost --reference-concurrency 64 --device cpu --fast-path --out "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "$s rc=$? $(date -u +%T)" >> "$OUT/progress.txt"
done
