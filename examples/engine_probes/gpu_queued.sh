#!/usr/bin/env bash
# One device call: queued fixed rounds (EngineConfig.spec_rounds) against off and fixed, round by round (round_trace.py,
# both pairs, c = 1 and 32) and on the reference pair's own engine (gpu_planner.sh real: closed batch, 512 new
# tokens, median of REPS). Carried: .slimwhl and .evaldata/data.tar.gz. Everything ends in $OUT/queued.tar and
# $OUT/real.tar.
set -uo pipefail
source examples/device_setup.sh  # OUT, W, SITE; the carried wheel, this checkout, the datasets
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/env.txt
python3 examples/engine_probes/round_trace.py --pair ref --out $W/ref --modes off,fixed,queued --concurrency 1,32 \
  --steps 10 --max-new-tokens 4224 --trace-at queued:1,queued:32 > $W/ref.log 2>&1; head -10 $W/ref/round_trace.md
python3 examples/engine_probes/round_kernels.py $W/ref/trace_*.json.gz --json $W/ref/round_kernels.json > $W/ref/round_kernels.md 2>&1
python3 examples/engine_probes/round_trace.py --pair 8b --out $W/8b --modes off,fixed,queued --concurrency 1,32 \
  --steps 4 --max-new-tokens 1920 --no-profile > $W/8b.log 2>&1; head -10 $W/8b/round_trace.md
mkdir -p $OUT && tar cf $OUT/queued.tar -C $W .
[[ -n "${REAL:-1}" ]] && REPS=${REPS:-5} BUDGET_S=${REAL_S:-300} bash examples/reference_pair/gpu_planner.sh real --modes off,fixed,queued
