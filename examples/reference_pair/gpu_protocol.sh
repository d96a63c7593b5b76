#!/usr/bin/env bash
# Runs `python examples/research/online_protocol.py` once per line of RUNS (a name, then that run's arguments), WAVE runs at
# a time side by side on one GPU, every one stopped by BUDGET_S (each keeps what it measured: protocol.json is written
# after every measurement). One short warm-up run first fills the Triton and kernel-tuning caches the others read.
# Inputs carried beside the checkout: WHEELS (default .slimwhl/, slim_wheel.py) and DATA (default .gpudata/data: the
# eval files of the sets named in RUNS, copied from shared/data).
# Outputs in $OUT: runs.tar (NAME/protocol.json and NAME.log per run), timings.txt, gpu_usage.csv.
# WAVE: each run holds up to ~5 GiB while it trains; 14 side by side peaked at 69 GiB on an 80 GB H100, 19 ran
# out of memory in some updates (each such update fails and is recorded as failed; serving goes on).
#   RUNS=examples/reference_pair/online_runs/sweep_alpaca.txt BUDGET_S=540 bash examples/reference_pair/gpu_protocol.sh
# CPU smoke: INSTALL=0 DEVICE=cpu WAVE=1 RUNS=<file with tiny runs> bash <this>
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/runs"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ADAFLASH_DATA="$PWD/${DATA:-.gpudata/data}"
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; BUDGET_S=${BUDGET_S:-540}; RUNS=${RUNS:?RUNS=<file of runs>}
stamp() { echo "$SECONDS s: $*" | tee -a "$OUT/timings.txt"; }
if [[ ${INSTALL:-1} == 1 ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.slimwhl}/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  $PY -m pip install -q --no-build-isolation --no-deps -e . > /dev/null || exit 1
fi
if [[ $DEVICE == cuda ]]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 5 > "$OUT/gpu_usage.csv" &
  SAMPLER=$!; trap 'kill $SAMPLER 2> /dev/null' EXIT
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
T=adaflash_hf/reference/target; D=${DRAFTER:-adaflash_hf/reference/drafter}
stamp "installed"
[[ ${WARMUP:-1} == 1 ]] && timeout 200 $PY examples/research/online_protocol.py --target $T --drafter $D --dataset ${WARM_DATASET:-alpaca_eval} --methods off \
  --held-out 32 --updates 0 --device $DEVICE --out /tmp/warmup > "$OUT/runs/warmup.log" 2>&1
stamp "warm-up done (rc $?)"
DEADLINE=$((BUDGET_S - 20)); PIDS=()
while read -r name args; do
  [[ -z $name || $name == \#* ]] && continue
  while (( $(for p in "${PIDS[@]}"; do kill -0 "$p" 2> /dev/null && echo; done | wc -l) >= ${WAVE:-12} )); do sleep 1; done
  limit=$((DEADLINE - SECONDS)); (( limit < 10 )) && limit=10
  ( OMP_NUM_THREADS=1 timeout -k 5 $limit $PY examples/research/online_protocol.py --target $T --drafter $D $args \
      --device $DEVICE --out "$OUT/runs/$name" > "$OUT/runs/$name.log" 2>&1; echo "exit $? after $SECONDS s" >> "$OUT/runs/$name.log" ) &
  PIDS+=($!)
done < "$RUNS"
wait "${PIDS[@]}"
stamp "runs done: $(grep -h '^exit' "$OUT"/runs/*.log | cut -d' ' -f2 | sort | uniq -c | tr '\n' ' ')(exit codes)"
[[ $DEVICE == cuda ]] && kill $SAMPLER 2> /dev/null
(cd "$OUT" && tar cf runs.tar runs && rm -rf runs)
ls -la "$OUT"
