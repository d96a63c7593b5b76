#!/bin/bash
# $1: comma list of sets, one at a time; outputs in /tmp/c1e (copied into bench/ beside this script after the run)
cd /work/main
IFS=, read -r -a SETS <<< "$1"
for s in "${SETS[@]}"; do
  n=$(echo "$s" | tr ':' '_')
  ADAFLASH_DATA=/work/shared/data OMP_NUM_THREADS=1 python3 -m adaflash_hf.bench --reference --max-new-tokens 128 --dtype fp32 \
    --length-rate 2 --no-plots --quiet --datasets "$s" --split test --num-prompts 500 --concurrency 1 --warmup 0 \
    --methods plain,fixed,cost --device cpu --fast-path --out /tmp/c1e/$n > /tmp/c1e/$n.log 2>&1
  echo "$s done rc=$? $(date -u +%T)" >> /tmp/c1e/progress.txt
done
