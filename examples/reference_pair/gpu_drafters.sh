#!/usr/bin/env bash
# Train the reference drafters on one H200 in one device call (<= 10 min): one regeneration of the
# target's own answers over all four domains, then several drafters trained on it side by side
# (the shipped recipe plus ablations), the chat + prose-only drafter of the online experiments (its
# own regeneration), and the small autoregressive assistant of the `hf_assisted` baseline.
# Inputs carried beside the checkout: .whl/ (transformers wheel) and .devdata/ (make_devdata.py).
# Outputs: $OUT/<name>.tar per model, $OUT/logs.tar.
set -uo pipefail
export PYTHONUNBUFFERED=1 ADAFLASH_DATA="$PWD/.devdata/data" TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/ref; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
[[ -f .devdata/data.tar.gz && ! -d .devdata/data ]] && tar xzf .devdata/data.tar.gz -C .devdata
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
T=${TARGET:-adaflash_hf/reference/target}
TD="python3 -m adaflash_hf.training.train_drafter --target $T --prompts-per-sample 16 --max-new-tokens 160 --gen-batch-size 4096 --no-progress"
MIN=${DRAFT_MINUTES:-5.0}

# chat + prose only (the online experiments' unseen-domain protocol), with its own regeneration
timeout 520 $TD --out $W/chatprose --domains chat,prose --num-prompts 12000 --sampled-answers 2 --sampled-domains chat \
  --num-layers 5 --target-layer-ids 1,2,3,4,5 --batch-size 64 --minutes $MIN --eval-per-domain 8 > $W/chatprose.log 2>&1 &

# one regeneration over all four domains, reused by every four-domain drafter
timeout 190 $TD --out $W/regen --domains math,code,chat,prose --num-prompts ${REGEN_PROMPTS:-36000} --sampled-answers 1 \
  --sampled-domains math,code,chat --regen-cache $W/regen.jsonl --regen-only 2>&1 | tail -n 3

# drafters side by side: NAME LAYERS TARGET_LAYERS BATCH
for spec in ${VARIANTS:-"d5:5:1,2,3,4,5:64" "d3:3:1,3,5:64"}; do
  IFS=: read -r name layers tl bs <<< "$spec"
  timeout 330 $TD --out $W/$name --domains math,code,chat,prose --regen-cache $W/regen.jsonl --num-layers $layers \
    --target-layer-ids $tl --batch-size $bs --minutes $MIN --eval-per-domain 8 > $W/$name.log 2>&1 &
done

# the small autoregressive assistant, trained on the same regenerated answers
python3 examples/reference_pair/assistant_corpus.py --regen-cache $W/regen.jsonl --target $T --out $W/acorpus
timeout 200 python3 -m adaflash_hf.training.train_target --data $W/acorpus --out $W/assistant --minutes 2.5 \
  --hidden-size 128 --layers 2 --sample-tokens 0 > $W/assistant.log 2>&1 &
wait
for f in $W/*.log; do echo "== $f"; grep -v "Warning\|it/s\]" $f | tail -n 12; done
# the device tool returns files up to ~15 MB: each model travels as 14 MB parts (cat NAME.tar.* | tar x)
for d in $W/chatprose $W/d5 $W/d3 $W/assistant/target; do
  [[ -d $d ]] || continue
  name="$(basename $(dirname $d))_$(basename $d)"
  tar cf - --exclude='*.jsonl' -C $(dirname $d) $(basename $d) | split -b 14M - "$OUT/$name.tar."
done
tar cf "$OUT/logs.tar" -C $W $(cd $W && ls *.log */train_log.jsonl */train_summary.json 2>/dev/null)
ls -la "$OUT"
