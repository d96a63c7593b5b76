#!/usr/bin/env bash
# One device call: the engine round traced kernel by kernel (round_trace.py --trace-at, then round_kernels.py), for
# the reference pair and the Qwen3-8B shape, off and fixed at c = 1 and 32. Carried: .slimwhl (transformers) and
# .evaldata/data.tar.gz. Everything ends in $OUT/rounds.tar (raw JSON, markdown, Chrome traces, log).
#   bash examples/engine_probes/gpu_rounds.sh            # PAIRS="ref 8b" MODES=off,fixed CONC=1,32 TRACE_AT=...
set -uo pipefail
source examples/device_setup.sh  # OUT, W, SITE; the carried wheel, this checkout, the datasets
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null; } | tee $W/env.txt
rc=0
for pair in ${PAIRS:-ref 8b}; do
  steps=$([[ $pair == 8b ]] && echo 10 || echo 20); max_new=$((16 * (3 + 3 * steps) + 16))
  python3 examples/engine_probes/round_trace.py --pair $pair --out $W/$pair --modes ${MODES:-off,fixed} \
    --concurrency ${CONC:-1,32} --steps $steps --max-new-tokens $max_new --trace-at ${TRACE_AT:-off:1,fixed:1,fixed:32} \
    "$@" > $W/$pair.log 2>&1 || { rc=$?; tail -20 $W/$pair.log; }
  python3 examples/engine_probes/round_kernels.py $W/$pair/trace_*.json.gz --json $W/$pair/round_kernels.json \
    > $W/$pair/round_kernels.md 2>&1 || rc=$?
  head -12 $W/$pair/round_trace.md
done
mkdir -p $OUT && tar cf $OUT/rounds.tar -C $W . && echo "gpu_rounds.sh: rc $rc, wrote $OUT/rounds.tar"
exit $rc
