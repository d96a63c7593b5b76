#!/usr/bin/env bash
# The leave-domain-out protocol on one GPU machine, in two device calls on the SAME machine (a warm machine keeps /tmp;
# the four drafters, 18 MB each, are too large to come back and be carried again):
#   bash examples/online_protocol/gpu.sh drafters [leave_out.py flags]   # call 1: regeneration, twin, no-math/code/chat
#   bash examples/online_protocol/gpu.sh recovery [recovery.py flags]    # call 2: the protocol on call 1's drafters
# Carried beside the checkout: .slimwhl (transformers), .whl (the server's wheels: fastapi, starlette, pydantic,
# pydantic_core, annotated_types, annotated_doc, typing_extensions, typing_inspection, opentelemetry_api, uvicorn) and
# .evaldata/data.tar.gz (the shared data). Call 1 also checks that the server imports, so call 2 cannot fail on it.
# Outputs in $OUT: drafters.tar or recovery.tar (tables, json, plots, logs; no weights), and the driver's log.
# CPU smoke of both drivers: python examples/online_protocol/leave_out.py --smoke ... / recovery.py --smoke ...
set -uo pipefail
STAGE=${1:?usage: gpu.sh drafters|recovery [driver flags]}; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/adaflash_leave_out
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ${WHEELS:-.slimwhl}/*.whl ${SERVE_WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p .evaldata/x && { [[ -d .evaldata/x/data ]] || tar xzf .evaldata/data.tar.gz -C .evaldata/x; } || exit 1
export ADAFLASH_DATA="$PWD/.evaldata/x/data"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, fastapi, uvicorn; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fastapi', fastapi.__version__)"
python3 -c "from adaflash_hf.serve.server import require_serve_extra; require_serve_extra(); print('server imports: ok')" || exit 1
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 5 > "$OUT/gpu_usage.csv" &
SAMPLER=$!; trap 'kill $SAMPLER 2> /dev/null' EXIT
if [[ $STAGE == drafters ]]; then
  rm -rf $W  # a warm machine's earlier call: start clean
  python3 examples/online_protocol/leave_out.py --out $W "$@" 2>&1 | tee "$OUT/leave_out.log"
  tar cf "$OUT/drafters.tar" -C $W leave_out.json leave_out.md logs \
    $(cd $W && ls drafters/*/train_summary.json drafters/*/train_log.jsonl drafters/*/config.json 2> /dev/null)
elif [[ $STAGE == recovery ]]; then
  rm -rf $W/recovery
  python3 examples/online_protocol/recovery.py --drafters $W/drafters --out $W/recovery "$@" 2>&1 | tee "$OUT/recovery.log"
  [[ -d $W/recovery ]] && tar cf "$OUT/recovery.tar" --exclude='versions' -C $W recovery
else
  echo "unknown stage $STAGE (drafters or recovery)"; exit 2
fi
ls -la "$OUT"
