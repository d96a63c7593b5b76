# call 1: issue 58's round times (before 8285eed / after 2714d2e, alternated twice) and issue 52's plan-trace variants on HEAD
P=/tmp/site; R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $P .slimwhl/*.whl
mkdir -p /tmp/ev && tar xzf .evaldata/data.tar.gz -C /tmp/ev; export ADAFLASH_DATA=/tmp/ev/data PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/env.txt
PYTHONPATH=$P python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $R/env.txt
for t in before after; do ln -sfn $PWD/adaflash_hf/reference .evaldata/trees/$t/adaflash_hf/reference; done
for rep in 1 2; do for t in before after; do
  s=$(date +%s); (cd .evaldata/trees/$t && PYTHONPATH=$PWD:$P timeout 110 python3 examples/engine_probes/round_trace.py --out $R/rt_${t}_$rep --modes off,fixed --concurrency 1,32) > $R/rt_${t}_$rep.log 2>&1
  echo "$t $rep rc=$? $(( $(date +%s) - s )) s"; grep "^| " $R/rt_${t}_$rep/round_trace.md | head -9; tar czf $OUT/c1.tgz -C $R .
done; done
s=$(date +%s); PYTHONPATH=$P timeout 120 python3 examples/engine_probes/plain_read.py --out $R/pr --concurrency 1,32,128 > $R/pr.log 2>&1; echo "pr rc=$? $(( $(date +%s) - s )) s"; cat $R/pr/plain_read.md; tar czf $OUT/c1.tgz -C $R .
tar czf $OUT/c1.tgz -C $R .
