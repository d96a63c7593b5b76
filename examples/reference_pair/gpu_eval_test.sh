#!/usr/bin/env bash
# BENCHMARKS' top table on the test slices (issue 36 items 2-4), the shipped reference pair, greedy, float32, 128 tokens:
# the six sets, MT-bench (both turns) and Spec-Bench's five other categories (spec_bench_all), each set capped at
# PROMPTS prompts of its slice (VAL_PROMPTS / SAMPLE_PROMPTS for the validation / sampling phases, default PROMPTS). Three phases, several `adaflash bench` processes sharing the one GPU in each:
#   1. validation: plain + prompt_lookup_grid (concurrency 64): each set's best prompt-lookup setting -> val_*/bench.json;
#      and fixed / cost with and without the prompt n-gram rule (fixed_alone, cost_alone: the drafter alone) and with
#      its candidates verified up to 31 tokens (fixed_wide, cost_wide)
#   2. test, tau: plain, fixed, cost (the default rule), adaptive (the paper's floor rule, rate 2), fixed_alone, cost_alone,
#      fixed_wide, cost_wide,
#      prompt lookup default (prompt_lookup_exact) and best of grid
#      (prompt_lookup_grid, the setting chosen in 1), concurrency 64, every output compared with plain
#   3. test, wall-clock at batch 1 on the first WALL_PROMPTS prompts: plain, plain_static (transformers' static cache,
#      compiled: its fastest plain path), prompt_lookup, prompt_lookup_tuned,
#      fixed, cost, adaptive, one process at a time (each group may use what the phase's timeout has left), after an
#      untimed pass over the same prompts (graph captures, compiles and kernel choices are set-up, not decoding)
#   4. (sample) test, tau under sampling at TEMPS (default "0.7 1.0"), top-p 0.95, seed 0, concurrency 64: the same methods as 2
#   5. (dist) examples/sampling_distribution_check.py at its defaults (speculative against plain sampling, with controls)
#   6. (c1) test, tau at concurrency 1 (issue 35's goal: `cost` keeps >= 97% of `fixed`'s tau): fixed and cost, every
#      output compared with plain's rows decoded 64 at a time
# PHASES picks them (default "val tau wall"), WALL_METHODS the wall phase's methods and WALL_WARMUP its untimed prompts (default WALL_PROMPTS; fewer of either fit more groups in a call); without val, CHOICE names an earlier validation_choice.json. GROUPS_RUN
# picks groups of sets by index (default all: one call can run the wall phase for half of them).
# Needs the eval + training data (the slices drop training duplicates): carry .evaldata (written by
# `python examples/reference_pair/make_devdata.py --out .evaldata`) and .slimwhl. LIMITS="V T W S D C": each phase's
# timeout in seconds (default "120 200 180 300 200 420"). --smoke: CPU, 2 prompts, 16 tokens.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SIX=gsm8k,mathqa,math500,codealpaca,sharegpt,prose
if [[ ${1:-} == --smoke ]]; then
  PROMPTS=2; WALL_PROMPTS=1; TOKENS=16; CONC=2; EXTRA="--device cpu --warmup 0"; WALL_EXTRA="--device cpu --warmup 0"; DIST_EXTRA="--smoke --device cpu"
  PROCS=("gsm8k,mt_bench" "spec_bench:qa"); LIMITS=(900 900 900)
else
  if [[ ${INSTALL:-1} == 1 ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .slimwhl/*.whl || exit 1
    export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
    mkdir -p /tmp/ev && tar xzf .evaldata/data.tar.gz -C /tmp/ev
  fi
  export PYTHONPATH=/tmp/site ADAFLASH_DATA=/tmp/ev/data
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  PROMPTS=${PROMPTS:-500}; WALL_PROMPTS=${WALL_PROMPTS:-16}; TOKENS=128; CONC=64; EXTRA="--warmup 0"; WALL_EXTRA="--warmup ${WALL_WARMUP:-$WALL_PROMPTS}"; DIST_EXTRA=""
  # one group per process: the big sets alone or in pairs, the small ones together (Spec-Bench's categories, ~40 test
  # prompts each, are spec_bench_all less mt_bench, which runs beside sharegpt)
  PROCS=("gsm8k,math500" "mathqa,prose" "codealpaca" "sharegpt,mt_bench" "spec_bench:translation,spec_bench:summarization,spec_bench:qa"
         "spec_bench:math_reasoning,spec_bench:rag"); read -r -a LIMITS <<< "${LIMITS:-120 200 180}"
fi
read -r -a PICK <<< "${GROUPS_RUN:-${!PROCS[*]}}"  # GROUPS_RUN="0 2": only those groups (indices into PROCS)
B="python3 -m adaflash_hf.bench --reference --max-new-tokens $TOKENS --dtype fp32 --length-rate 2 --no-plots --quiet"
phase() {  # phase NAME TIMEOUT ARGS...: one process per group, in parallel; the group's index names its folder
  local name=$1 limit=$2; shift 2
  local i pids=()
  for i in "${PICK[@]}"; do
    timeout "$limit" $B --datasets "${PROCS[$i]}" "$@" --out "$OUT/${name}_$i" > "$OUT/${name}_$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "phase $name: $(date -u +%T) rc=$rc"
}
phase_alone() {  # phase_alone NAME TIMEOUT ARGS...: the groups one after another, each with the GPU to itself
  # (timings: processes sharing the GPU measure each other); each group may use what the phase's TIMEOUT has left,
  # less an even share kept for every group after it
  local name=$1 limit=$2; shift 2
  local i rc=0 start=$SECONDS left n=${#PICK[@]} k=0
  for i in "${PICK[@]}"; do
    left=$(( limit - (SECONDS - start) )); each=$(( left - (n - k - 1) * left / (n - k) / 2 )); k=$((k + 1))
    (( each < 10 )) && each=10
    timeout "$each" $B --datasets "${PROCS[$i]}" "$@" --out "$OUT/${name}_$i" > "$OUT/${name}_$i.log" 2>&1 || rc=1
  done
  echo "phase $name (one process at a time): $(date -u +%T) rc=$rc"
}
SECONDS=0
PHASES=${PHASES:-val tau wall}; has() { [[ " $PHASES " == *" $1 "* ]]; }
if has val; then
phase val ${LIMITS[0]} --split validation --num-prompts ${VAL_PROMPTS:-$PROMPTS} --concurrency $CONC $EXTRA \
  --methods plain,prompt_lookup_grid,fixed,fixed_alone,fixed_wide,cost,cost_alone,cost_wide
# every validation run's choices in one file (each group's sets are in its own val_i/bench.json)
python3 - "$OUT" <<'EOF'
import json, sys, glob
runs = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/val_*/bench.json"))]
merged = dict(runs[0], results=[c for r in runs for c in r["results"]])
json.dump(merged, open(f"{sys.argv[1]}/validation_choice.json", "w"))
EOF
CHOICE="--prompt-lookup-choice $OUT/validation_choice.json"
else
cp "${CHOICE:-docs/logs/eval_test_h200/validation_choice.json}" "$OUT/validation_choice.json" || exit 1
CHOICE="--prompt-lookup-choice $OUT/validation_choice.json"
fi
has tau && phase tau ${LIMITS[1]} --split test --num-prompts $PROMPTS --concurrency $CONC $CHOICE $EXTRA \
  --methods plain,fixed,cost,adaptive,fixed_alone,cost_alone,fixed_wide,cost_wide,prompt_lookup_exact,prompt_lookup_grid
has wall && phase_alone wall ${LIMITS[2]} --split test --num-prompts $WALL_PROMPTS --concurrency 1 $CHOICE $WALL_EXTRA \
  --methods ${WALL_METHODS:-plain,plain_static,prompt_lookup,prompt_lookup_exact,prompt_lookup_tuned,prompt_lookup_grid,fixed,cost,adaptive,fixed_alone,fixed_wide}
for T in ${TEMPS:-0.7 1.0}; do  # the temperatures at once (TEMPS picks them): 6 processes each share the GPU
  has sample && phase "sample_T$T" ${LIMITS[3]:-300} --split test --num-prompts ${SAMPLE_PROMPTS:-$PROMPTS} --concurrency $CONC $CHOICE $EXTRA \
    --temperature $T --top-p 0.95 --seed 0 --methods plain,fixed,cost,adaptive,prompt_lookup_exact,prompt_lookup_grid &
done; wait
# issue 35's goal at batch 1: `fixed` and `cost` (the default) at concurrency 1 on the test slices, compared with plain's
# rows decoded CONC at a time (greedy float32 rows do not depend on the batch; plain at batch 1 would take most of the call)
has c1 && phase c1 ${LIMITS[5]:-420} --split test --num-prompts $PROMPTS --concurrency 1 --reference-concurrency $CONC \
  $EXTRA --methods fixed,cost
has dist && { timeout ${LIMITS[4]:-200} python3 examples/sampling_distribution_check.py $DIST_EXTRA --out "$OUT/distribution" \
  > "$OUT/distribution.log" 2>&1; echo "dist rc=$?"; }
echo "total ${SECONDS}s"
grep -h "BENCH FAILURE" "$OUT"/*.log | head -20
grep -L "No failures" "$OUT"/*/bench.md
# one file back: the device tool returns a handful of files
tar czf /tmp/eval_runs.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/eval_runs.tar.gz "$OUT/"
