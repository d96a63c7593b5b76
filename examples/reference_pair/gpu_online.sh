#!/usr/bin/env bash
# Section 3's online runs on the current pair, in one device call on one H200 (<= 9.5 min):
#   1. trains the chat + prose drafter (the v5 recipe: 5 layers, target layers 1-5, batch 128, lr 8e-4,
#      6 loader workers; DRAFT_MINUTES, default 2.5, of training) and sets its length rate (LENGTH_RATE, v5's 2);
#      beside it, a short run of the shipped pair fills the Triton cache for the processes of step 2;
#   2. runs `examples/research/online_experiment.py` on gsm8k and codealpaca (domains that drafter never saw) for
#      OPD with the per-token clip, OPD with the per-entry clip and OSD under the adaptive policy (POLICY; the
#      held-out tau also with the fixed policy), one process per (domain, method, seed; seed 0 serves the
#      stream in file order), all side by side on the one GPU (WAVE at once), each stopped before the call's end
#      (BUDGET_S) with its last measurement saved;
#   3. summarises them (summarise_online.py) and ships the drafter back.
# Inputs carried beside the checkout: WHEELS (default .whl/: the transformers wheel) and PACK (default .devdata/data.tar.xz, written
# by `python examples/reference_pair/make_devdata.py --data ../shared/data --out .devdata --online`).
# Outputs in $OUT (few files: the device returns at most 8): summary.md / summary.json, runs.tar (online/<domain>_
# <method>_s<seed>/online.json and .log, gpu_usage.csv: memory and utilisation every 5 s, gpu_apps.csv, timings.txt),
# chatprose_drafter.tar.?? (14 MB parts: cat chatprose_drafter.tar.* | tar x), logs.tar (training and warm-up logs).
# CPU smoke test: INSTALL=0 PY=python DEVICE=cpu DRAFTER=adaflash_hf/reference/drafter DATASETS=gsm8k SEEDS=0
#   ONLINE_UPDATES=1 ONLINE_HELD_OUT=4 ONLINE_STREAM=8 ONLINE_SPU=4 ONLINE_BATCH=4 ONLINE_TOKENS=16 bash <this>
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/online"; W=${WORK:-/tmp/ref}; mkdir -p "$W"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ADAFLASH_DATA="$W/pack/data"
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; BUDGET_S=${BUDGET_S:-540}
stamp() { echo "$SECONDS s: $*" | tee -a "$OUT/timings.txt"; }
if [[ ${INSTALL:-1} == 1 ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  $PY -m pip install -q --no-build-isolation --no-deps -e . || exit 1
fi
# always the carried pack, never a data folder an earlier call left on the machine
rm -rf "$W/pack"; $PY -c "import tarfile; tarfile.open('${PACK:-.devdata/data.tar.xz}').extractall('$W/pack', filter='data')" || exit 1
GPU=0; command -v nvidia-smi > /dev/null && [[ $DEVICE == cuda ]] && GPU=1
if [[ $GPU == 1 ]]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 5 > "$OUT/gpu_usage.csv" &
  SAMPLER=$!; trap 'kill $SAMPLER 2> /dev/null' EXIT
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
stamp "installed"
T=adaflash_hf/reference/target
POLICY=${POLICY:-adaptive}; TOKENS=${ONLINE_TOKENS:-96}; BATCH=${ONLINE_BATCH:-32}

# 1. the chat + prose drafter (unless DRAFTER names one), and the Triton cache beside it
if [[ -z ${DRAFTER:-} ]]; then
  DRAFTER=$W/chatprose; MIN=${DRAFT_MINUTES:-2.5}
  timeout ${TRAIN_LIMIT:-$($PY -c "print(int($MIN * 60 + 150))")} $PY -m adaflash_hf.training.train_drafter --target $T --out $DRAFTER \
    --domains chat,prose --num-prompts ${DRAFT_PROMPTS:-12000} --prompts-per-sample 16 --sampled-answers 2 --sampled-domains chat \
    --max-new-tokens 160 --gen-batch-size 4096 --num-layers 5 --target-layer-ids 1,2,3,4,5 --batch-size ${DRAFT_BATCH:-128} \
    --num-workers ${WORKERS:-6} --lr ${LR:-8e-4} --minutes $MIN --eval-per-domain 8 --eval-domains math,code,prose \
    --device $DEVICE --no-progress > $W/chatprose.log 2>&1 &
  TRAIN=$!
  timeout 240 $PY examples/research/online_experiment.py --target $T --drafter adaflash_hf/reference/drafter --dataset gsm8k \
    --methods osd --updates 0 --held-out $BATCH --measure-batch $BATCH --stream 0 --max-new-tokens $TOKENS --policy $POLICY --measure-fixed \
    --device $DEVICE --out $W/warmup > $W/warmup.log 2>&1
  stamp "warm-up done (rc $?)"
  wait $TRAIN; rc=$?
  grep -v "Warning\|it/s\]" $W/chatprose.log | tail -n 12
  stamp "drafter trained (rc $rc)"
  [[ -f $DRAFTER/config.json ]] || { echo "no drafter was saved"; exit 1; }
  # the one key changed in place (a config round trip would rewrite others)
  $PY -c "import json, os; p = '$DRAFTER/config.json'; c = json.load(open(p)); c['length_rate'] = float(${LENGTH_RATE:-2.0})
open(p + '.tmp', 'w').write(json.dumps(c, indent=2) + '\n'); os.replace(p + '.tmp', p)" || exit 1
  tar cf - --exclude='*.jsonl' -C $W chatprose | split -b 14M - "$OUT/chatprose_drafter.tar."
fi

# 2. one process per (domain, method, seed), WAVE at once, each stopped in time to leave 30 s for step 3
DEADLINE=$((BUDGET_S - 30)); (( DEADLINE - SECONDS < 60 )) && DEADLINE=$((SECONDS + 60))
stamp "online runs start, all stopped by ${DEADLINE} s"
PIDS=()
for ds in ${DATASETS:-gsm8k codealpaca}; do
  for seed in ${SEEDS:-0 1 2}; do
    for v in ${VARIANTS:-opd:token opd:entry osd}; do
      method=${v%%:*}; clip=token; name=${ds}_${method}_s$seed
      [[ $v == *:* ]] && { clip=${v#*:}; name=${ds}_${method}-${clip}_s$seed; }
      while (( $(for p in "${PIDS[@]}"; do kill -0 $p 2> /dev/null && echo; done | wc -l) >= ${WAVE:-18} )); do sleep 1; done
      log="$OUT/online/$name.log"; limit=$((DEADLINE - SECONDS)); (( limit < 10 )) && limit=10  # timeout 0 would mean none
      ( OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout -k 5 $limit \
          $PY examples/research/online_experiment.py --target $T --drafter $DRAFTER --dataset $ds --methods $method \
          --clip-mode $clip --policy $POLICY --measure-fixed --seed $seed --updates ${ONLINE_UPDATES:-4} --held-out ${ONLINE_HELD_OUT:-64} \
          --measure-batch $BATCH --stream ${ONLINE_STREAM:-700} --samples-per-update ${ONLINE_SPU:-128} --stream-batch $BATCH \
          --max-new-tokens $TOKENS --device $DEVICE --out "$OUT/online/$name" > "$log" 2>&1
        echo "exit $? after $SECONDS s" >> "$log" ) &
      PIDS+=($!)
    done
  done
done
if [[ $GPU == 1 ]]; then  # memory per process, twice while they run
  for wait_s in 40 60; do sleep $wait_s; date -u +%T >> "$OUT/gpu_apps.csv"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/gpu_apps.csv"; done
fi
wait "${PIDS[@]}"
stamp "online runs done: $(grep -h '^exit' "$OUT"/online/*.log | cut -d' ' -f2 | sort | uniq -c | tr '\n' ' ')(exit codes)"

# 3. the summary, the logs
$PY examples/reference_pair/summarise_online.py "$OUT/online" --out "$OUT" | tail -n 40
LOGS=$(cd $W && ls *.log */train_log.jsonl */train_summary.json 2> /dev/null); [[ -n $LOGS ]] && tar cf "$OUT/logs.tar" -C $W $LOGS
stamp "done"
[[ $GPU == 1 ]] && kill $SAMPLER 2> /dev/null
(cd "$OUT" && tar cf runs.tar online $(ls gpu_usage.csv gpu_apps.csv timings.txt 2> /dev/null) && rm -rf online gpu_usage.csv gpu_apps.csv)
ls -la "$OUT"
