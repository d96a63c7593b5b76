#!/usr/bin/env bash
# CPU comparison of the two length-head forms on the frozen v5 body (issue 18), run from /work/main
set -uo pipefail
source /work/venv/bin/activate
cd /work/main
export ADAFLASH_DATA=/work/shared/data TOKENIZERS_PARALLELISM=false
W=/work/scratch/heads
TD="python -m adaflash_hf.training.train_drafter --target adaflash_hf/reference/target --device cpu --prompts-per-sample 16 --max-new-tokens 160 --no-progress --seed 0"
date
[[ -f $W/regen.jsonl ]] || $TD --out $W/regen --domains math,code,chat,prose --num-prompts ${N:-512} --gen-batch-size 128 \
  --regen-cache $W/regen.jsonl --regen-only > $W/regen.log 2>&1
date
for H in released paper; do
  $TD --out $W/head_$H --init-from adaflash_hf/reference/drafter --length-head-type $H --domains math,code,chat,prose \
    --regen-cache $W/regen.jsonl --num-layers 5 --target-layer-ids 1,2,3,4,5 --steps 1 --lr 0 \
    --length-head-steps ${STEPS:-150} --max-anchors 32 --batch-size 8 --eval-per-domain 0 > $W/head_$H.log 2>&1
  date
done
for H in released paper; do
  for R in 1 2; do
    python -m adaflash_hf.bench --target adaflash_hf/reference/target --drafter $W/head_$H --datasets gsm8k,codealpaca,sharegpt \
      --num-prompts 16 --max-new-tokens 96 --methods fixed,adaptive --concurrency 16 --dtype fp32 --device cpu --warmup 0 \
      --length-rate $R --no-plots --out $W/bench_${H}_r$R > $W/bench_${H}_r$R.log 2>&1
    date
  done
done
echo done
