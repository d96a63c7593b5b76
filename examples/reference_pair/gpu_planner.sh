#!/usr/bin/env bash
# The verify-length planner's GPU rows in one device call each (a warm machine takes the second at once):
#   bash examples/reference_pair/gpu_planner.sh real       # the reference pair's own engine: off, fixed, default at
#                                                          # c = 1, 8, 32, 128, closed batch, median of REPS runs
#   bash examples/reference_pair/gpu_planner.sh replay     # the 8B-shaped replay: paper, paper_ref, gsm8k traces at
#                                                          # c = 1, 8, 32, 64, 128, this GPU's measured round cost
# Carried beside the checkout: .slimwhl (transformers) and .evaldata/data.tar.gz (the shared data). Everything the
# stage writes ends in one file, $OUT/STAGE.tar (the device returns at most 8 files).
set -uo pipefail
STAGE=${1:?usage: gpu_planner.sh real|replay}; shift
source examples/device_setup.sh  # OUT, W, SITE; the carried wheel, this checkout, the datasets
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
git log --oneline -1 2>/dev/null | tee -a $W/gpu.txt
case $STAGE in
  real) python3 examples/replay_bench.py --out $W/real --traces gsm8k --real-concurrency 1,8,32,128 --concurrency '' \
          --arrivals closed --modes off,fixed --reps ${REPS:-5} --max-new-tokens ${MAX_NEW:-512} --budget-s ${BUDGET_S:-480} \
          "$@" > $W/real.log 2>&1 ;;
  replay) python3 examples/replay_bench.py --out $W/replay --traces paper,paper_ref,gsm8k --concurrency 1,8,32,64,128 \
          --arrivals closed --measure-cost --real-concurrency '' --modes off,fixed,packed:adaptive \
          --budget-s ${BUDGET_S:-500} "$@" > $W/replay.log 2>&1 ;;
  *) echo "gpu_planner.sh: unknown stage $STAGE (real or replay)" >&2; exit 2 ;;
esac
rc=$?
grep -E "^\[|identical to plain" $W/$STAGE.log | tail -40
mkdir -p $OUT && tar cf $OUT/$STAGE.tar -C $W . && echo "gpu_planner.sh: $STAGE rc $rc, wrote $OUT/$STAGE.tar"
exit $rc
