#!/usr/bin/env bash
# Train the reference drafters on one H200, one device call (<= 10 min) per mode:
#   bash examples/reference_pair/gpu_drafters.sh four       # the shipped four-domain drafter + the AR assistant
#   bash examples/reference_pair/gpu_drafters.sh chatprose  # the chat + prose-only drafter of the online runs (the v5
#     settings: batch 128, lr 8e-4, 6 loader workers; gpu_online.sh trains the same recipe before its runs)
#   bash examples/reference_pair/gpu_drafters.sh heads      # the two length-head forms (released, paper), each fresh
#     on the shipped drafter's body and trained the same way (HEAD_STEPS offline head steps, frozen drafter, HEAD_ANCHORS
#     anchors per sample; a step runs the whole drafter forward: 800 steps at 512 anchors did not finish in 160 s), then
#     each head's adaptive tau beside fixed (bench, HEAD_SETS x HEAD_PROMPTS prompts, length rates HEAD_RATES)
# `four` regenerates the target's answers over all four domains once (REGEN_PROMPTS prompts, one extra sampled answer
# per prompt of SAMPLED_DOMAINS, MAX_PROMPT_TOKENS; REGEN_LIMIT, default 200 s, bounds it), trains one drafter on them
# (LAYERS / TARGET_LAYERS / BATCH / WORKERS / LR / DRAFT_MINUTES / BLOCK_ATTENTION / MAX_LENGTH; the defaults are v5's
# recipe but DRAFT_MINUTES: 5.5, v5 ran 6.0; v8's and v9's last calls ran MAX_PROMPT_TOKENS=1536 MAX_LENGTH=1792, v9's
# last two also SAMPLED_DOMAINS=math,code,chat,prose REGEN_LIMIT=260) and, beside it, the small autoregressive
# assistant of the `hf_assisted` baseline on the same answers. One drafter per call: three drafters at batch 64 beside
# each other ran out of the H200's 140 GB (docs/logs/drafters_gpu_1712).
# A longer `four` run cut into several calls: carry the last call's drafter and set INIT_FROM=<its folder> (training
# continues from its weights; the layer flags must match it), SEED=<n> (other prompts regenerated) and ASSISTANT=0.
# Inputs carried beside the checkout: WHEELS (default .whl/: the transformers wheel; slim_wheel.py writes a smaller one,
# .slimwhl/) and .devdata/ (make_devdata.py).
# Outputs: $OUT/<name>.tar.?? (14 MB parts: cat NAME.tar.* | tar x), $OUT/logs.tar.
set -uo pipefail
MODE=${1:?usage: gpu_drafters.sh four|chatprose|heads}
export PYTHONUNBUFFERED=1 ADAFLASH_DATA="$PWD/.devdata/data" TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/ref
# a warm machine keeps /tmp: start clean, or a new SEED would reuse the last call's regeneration (regen.jsonl)
rm -rf $W; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site
[[ -f .devdata/data.tar.gz && ! -d .devdata/data ]] && tar xzf .devdata/data.tar.gz -C .devdata
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
T=${TARGET:-adaflash_hf/reference/target}
TD="python3 -m adaflash_hf.training.train_drafter --target $T --prompts-per-sample 16 --max-new-tokens 160 --gen-batch-size 4096 --no-progress --seed ${SEED:-0} --max-prompt-tokens ${MAX_PROMPT_TOKENS:-384} --max-length ${MAX_LENGTH:-1024}"
MIN=${DRAFT_MINUTES:-5.5}
# the training budget plus loading, held-out evaluation and saving (~40 s on the H200)
LIMIT=$(python3 -c "print(int($MIN * 60 + 75))")

if [[ $MODE == chatprose ]]; then
  timeout $((LIMIT + 90)) $TD --out $W/chatprose --domains chat,prose --num-prompts 12000 --sampled-answers 2 \
    --sampled-domains chat --num-layers 5 --target-layer-ids 1,2,3,4,5 --batch-size ${BATCH:-128} \
    --num-workers ${WORKERS:-6} --lr ${LR:-8e-4} --minutes $MIN --eval-per-domain 8 > $W/chatprose.log 2>&1
  MODELS="$W/chatprose"
elif [[ $MODE == heads ]]; then
  RG="--domains math,code,chat,prose --num-prompts ${REGEN_PROMPTS:-12000} --regen-cache $W/regen.jsonl"
  timeout 200 $TD --out $W/regen $RG --regen-only 2>&1 | tail -n 3
  for H in released paper; do  # side by side: the drafter is frozen, the head small
    timeout $LIMIT $TD --out $W/head_$H --init-from adaflash_hf/reference/drafter --length-head-type $H \
      $RG --num-layers 5 --target-layer-ids 1,2,3,4,5 \
      --steps 1 --lr 0 --length-head-steps ${HEAD_STEPS:-2000} --max-anchors ${HEAD_ANCHORS:-64} --batch-size ${BATCH:-64} \
      --eval-per-domain 0 \
      > $W/head_$H.log 2>&1 &
  done
  wait
  MODELS="$W/head_released $W/head_paper"
  for H in released paper; do  # the comparison: each head's adaptive tau and verify length beside fixed, per rate
    for R in ${HEAD_RATES:-1 2}; do
      [[ -f $W/head_$H/config.json ]] && timeout 120 python3 -m adaflash_hf.bench --target $T --drafter $W/head_$H \
        --datasets ${HEAD_SETS:-gsm8k,codealpaca,sharegpt} --num-prompts ${HEAD_PROMPTS:-64} --max-new-tokens 128 \
        --methods plain,fixed,adaptive --length-rate $R --concurrency 64 --dtype fp32 --warmup 0 --no-plots \
        --out $W/bench_${H}_r$R > $W/bench_${H}_r$R.log 2>&1
    done
  done
else
  # the training call passes the regeneration's settings too: train_drafter refuses a cache made with others
  RG="--domains math,code,chat,prose --num-prompts ${REGEN_PROMPTS:-36000} --sampled-answers 1 --sampled-domains ${SAMPLED_DOMAINS:-math,code,chat} --regen-cache $W/regen.jsonl"
  timeout ${REGEN_LIMIT:-200} $TD --out $W/regen $RG --regen-only 2>&1 | tail -n 3
  timeout $LIMIT $TD --out $W/drafter $RG \
    --num-layers ${LAYERS:-5} --target-layer-ids ${TARGET_LAYERS:-1,2,3,4,5} --batch-size ${BATCH:-128} \
    --num-workers ${WORKERS:-6} --lr ${LR:-8e-4} --minutes $MIN --eval-per-domain 8 ${INIT_FROM:+--init-from $INIT_FROM} \
    --block-attention ${BLOCK_ATTENTION:-dense} \
    > $W/drafter.log 2>&1 &
  MODELS="$W/drafter"
  if [[ ${ASSISTANT:-1} == 1 ]]; then
    python3 examples/reference_pair/assistant_corpus.py --regen-cache $W/regen.jsonl --target $T --out $W/acorpus
    timeout 200 python3 examples/research/train_target.py --data $W/acorpus --out $W/assistant --minutes 2.5 \
      --hidden-size 128 --layers 2 --sample-tokens 0 > $W/assistant.log 2>&1
    MODELS="$MODELS $W/assistant/target"
  fi
  wait
fi
for f in $W/*.log; do echo "== $f"; grep -v "Warning\|it/s\]" $f | tail -n 12; done
for d in $MODELS; do
  [[ -f $d/config.json ]] || { echo "missing: $d"; continue; }
  name="$(basename $(dirname $d))_$(basename $d)"
  tar cf - --exclude='*.jsonl' -C $(dirname $d) $(basename $d) | split -b 14M - "$OUT/$name.tar."
done
tar cf "$OUT/logs.tar" -C $W $(cd $W && ls *.log */train_log.jsonl */train_summary.json bench_*/bench.* 2>/dev/null)
ls -la "$OUT"
