#!/bin/bash
# $1: comma list of sets, run one set at a time; outputs in /tmp/c1g (copied here after the run)
cd /work/main
IFS=, read -r -a SETS <<< "$1"
for s in "${SETS[@]}"; do
  n=$(echo "$s" | tr ':' '_')
  ADAFLASH_DATA=/work/shared/data OMP_NUM_THREADS=1 python3 -m adaflash_hf.bench --reference --max-new-tokens 128 --dtype fp32 \
    --length-rate 2 --no-plots --quiet --datasets "$s" --split test --num-prompts 500 --concurrency 1 --warmup 0 \
    --methods plain,cost --device cpu --out /tmp/c1g/$n > /tmp/c1g/$n.log 2>&1
  echo "$s done rc=$? $(date -u +%T)" >> /tmp/c1g/progress.txt
done
