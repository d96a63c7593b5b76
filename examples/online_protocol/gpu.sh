#!/usr/bin/env bash
# The leave-domain-out protocol on one GPU machine, in two device calls on the SAME machine (a warm machine keeps /tmp;
# the drafters, ~7 MB each, come back from call 1 but do not fit beside the checkout in a second call's carry):
#   bash examples/online_protocol/gpu.sh drafters [leave_out.py flags]   # call 1: regeneration, twin, no-FAMILY each
#   bash examples/online_protocol/gpu.sh recovery [recovery.py flags]    # call 2: the protocol on call 1's drafters
# Each driver's --budget-s bounds its command. In a 600 s call: drafters --parallel 4 --minutes 6 --budget-s 540
# (the twin and no-math, no-code, no-chat side by side), then recovery --seeds 1 --parallel 6 --budget-s 540 (seed 0
# of every family and method, the twins beside them); a later call adds seeds: recovery --first-seed 1 --seeds 3.
# In call 2 every run's slice of the budget is its whole wall clock: it measures its start drafter before any traffic, stops the traffic in time for its
# newest version's measurement (timed from the start's), so a run cut by its slice still reports tau at the start.
# Carried beside the checkout: .slimwhl (transformers), .whl (the server's wheels, for the device's CPython 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl fastapi \
#     starlette pydantic pydantic_core annotated_types annotated_doc typing_extensions typing_inspection uvicorn h11 \
#     click anyio sniffio idna opentelemetry-api importlib_metadata zipp prometheus_client)
# and .evaldata/data.tar.gz with the training splits (`python examples/reference_pair/make_devdata.py --data
# ../shared/data --out .evaldata`, 11 MB; an --eval-only one has no gsm8k/train.jsonl). Call 1 also checks that the server imports, so call 2 cannot fail on it.
#   bash examples/online_protocol/gpu.sh all [recovery.py flags]         # both in one call, smaller (MINUTES, SEEDS, ...)
# Outputs in $OUT: leave_out.tar (table, json, logs) and drafter_NAME.tar (weights, bf16), or recovery.tar (table,
# json, plot, every run's protocol.json and logs; no weights), the driver's log and gpu_usage.csv.
# CPU smoke of both drivers: python examples/online_protocol/leave_out.py --smoke ... / recovery.py --smoke ...
set -uo pipefail
STAGE=${1:?usage: gpu.sh drafters|recovery|all [driver flags]}; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=${WORK:-/tmp/adaflash_leave_out}; SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
  ${WHEELS:-.slimwhl}/*.whl ${SERVE_WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=$SITE
# unpacked again each call: a warm machine keeps an earlier call's .evaldata/x, perhaps of an --eval-only bundle
rm -rf .evaldata/x && mkdir -p .evaldata/x && tar xzf .evaldata/data.tar.gz -C .evaldata/x || exit 1
export ADAFLASH_DATA="$PWD/.evaldata/x/data"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, fastapi, uvicorn; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fastapi', fastapi.__version__)"
python3 -c "from adaflash_hf.serve.server import require_serve_extra; require_serve_extra(); print('server imports: ok')" || exit 1
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 5 > "$OUT/gpu_usage.csv" &
SAMPLER=$!; trap 'kill $SAMPLER 2> /dev/null' EXIT
drafters() {
  rm -rf $W  # a warm machine's earlier call: start clean
  python3 examples/online_protocol/leave_out.py --out $W "$@" 2>&1 | tee "$OUT/leave_out.log"
  tar cf "$OUT/leave_out.tar" -C $W leave_out.json leave_out.md logs
  for d in $W/drafters/*/; do tar cf "$OUT/drafter_$(basename $d).tar" -C $W/drafters $(basename $d); done  # ~7 MB each
}
recovery() {
  [[ " $* " == *" --first-seed "* ]] || rm -rf $W/recovery  # --first-seed adds seeds to an earlier call's runs
  python3 examples/online_protocol/recovery.py --drafters $W/drafters --out $W/recovery "$@" 2>&1 | tee "$OUT/recovery.log"
  [[ -d $W/recovery ]] && tar cf "$OUT/recovery.tar" --exclude='versions' -C $W recovery
}
case $STAGE in
  drafters) drafters "$@" ;;
  recovery) recovery "$@" ;;
  # one call for both, at a smaller scale (if the two calls cannot share a machine); the environment sizes it
  all) drafters --parallel ${PARALLEL:-4} --minutes ${MINUTES:-2.5} --budget-s ${DRAFTERS_S:-290} --num-workers 2
       recovery --families ${FAMILIES:-math,code,chat} --seeds ${SEEDS:-1} --parallel ${RUNS:-6} \
         --budget-s ${RECOVERY_S:-250} "$@" ;;
  *) echo "unknown stage $STAGE (drafters, recovery or all)"; exit 2 ;;
esac
ls -la "$OUT"
