#!/usr/bin/env bash
# Train the reference pair and benchmark it, in one command on one H200 (the project's device tool).
# Inputs carried beside the checkout: .whl/ (transformers 5.23 wheel), .devdata/ (output of
# `python -m adaflash_hf.training.pretokenize --out .devdata`, plus a copy of the eval/training
# jsonl files under .devdata/data). Outputs go to $OUT (tar parts of at most 15 MB).
set -uo pipefail
export PYTHONUNBUFFERED=1 ADAFLASH_DATA="$PWD/.devdata/data" TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/ref; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# 1. target: ~12.6M-parameter Qwen3 on all four domains (10 passes over ~9M tokens)
timeout 150 python3 -m adaflash_hf.training.train_target --data .devdata --out $W/t --minutes 3 2>&1 | tail -n 25
tar cf - -C $W/t target | split -b 15M - "$OUT/target.tar.part-"

# 2. drafter: target's own greedy answers to chat + prose prompts, DFlash recipe, block 16
timeout 290 python3 -m adaflash_hf.training.train_drafter --target $W/t/target --out $W/d --domains chat,prose \
  --minutes 3 --num-prompts 1536 --max-new-tokens 192 --gen-batch-size 256 --eval-per-domain 0 2>&1 | tail -n 25
tar cf "$OUT/drafter.tar" -C $W d

# 3. benchmark: greedy tau per held-out domain, every method checked against plain decoding
timeout 150 python3 -m adaflash_hf.bench --target $W/t/target --drafter $W/d \
  --datasets gsm8k,mathqa,codealpaca,sharegpt,math500 --num-prompts 6 --max-new-tokens 128 \
  --methods plain,dflash_native,fixed,adaptive --dtype fp32 --warmup 1 --out $W/bench 2>&1 | tail -n 40
tar cf "$OUT/logs.tar" -C $W t/train_log.jsonl t/train_summary.json d/train_log.jsonl d/train_summary.json bench 2>/dev/null

# 4. online adaptation on a domain the drafter never saw (math): held-out tau per update, opd vs osd
timeout 120 python3 -m adaflash_hf.online.experiment --target $W/t/target --drafter $W/d --dataset gsm8k \
  --methods opd,osd --updates 4 --held-out 8 --stream 200 --max-new-tokens 96 --out $W/online 2>&1 | tail -n 12
tar cf "$OUT/logs.tar" -C $W t/train_log.jsonl t/train_summary.json d/train_log.jsonl d/train_summary.json bench online 2>/dev/null
ls -la "$OUT"
