# Sourced by the device scripts (examples/reference_pair/gpu_planner.sh, examples/engine_probes/gpu_rounds.sh and
# gpu_queued.sh) on a bare device machine: installs the carried transformers wheel (.slimwhl, or $WHEELS) and this
# checkout, unpacks the carried datasets (.evaldata/data.tar.gz) for ADAFLASH_DATA; sets OUT, SITE and W (a fresh
# work folder). Exits the calling script when a step fails.
OUT=${OUT:-/tmp/out}; W=$(mktemp -d); SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE ${WHEELS:-.slimwhl}/*.whl || exit 1
export PYTHONPATH=$SITE
mkdir -p .evaldata/x && { [[ -d .evaldata/x/data ]] || tar xzf .evaldata/data.tar.gz -C .evaldata/x; } || exit 1
export ADAFLASH_DATA="$PWD/.evaldata/x/data"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /dev/null || exit 1
