#!/bin/bash
# `adaflash demo` under the default (`cost`) and `fixed`, alternated (the demo runs one policy per process), 5 pairs,
# one thread each; every run prints its own plain-vs-speculative speedup. Then: python demo_table.py -> demo_table.md
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/logs/demo_cpu_1207/demo}; A=${A:-.venv/bin/adaflash}
for i in 1 2 3 4 5; do for p in cost fixed; do
  OMP_NUM_THREADS=1 $A demo --threads 1 --length-policy $p > "$OUT/${p}_$i.txt" 2>&1
  echo "$p $i rc=$? $(date -u +%T)" >> "$OUT/progress.txt"
done; done
