#!/usr/bin/env bash
# Issue 58's GPU check as it ran (device tool, one H100, 2026-12-07 05:40-05:44Z), from the repository root of main at
# 9c48702 with the two trees built beside it:
#   for t in before:8285eed after:2714d2e; do n=${t%%:*}; c=${t##*:}; mkdir -p .evaldata/trees/$n
#     git archive $c adaflash_hf examples pyproject.toml | tar -x -C .evaldata/trees/$n
#     rm -rf .evaldata/trees/$n/adaflash_hf/reference; done          # ab_rounds.sh links this checkout's weights
# 8285eed: the engine as mixins (Engine(VerifyLengths, DecodeSteps, RequestLifecycle)); 2714d2e: the composed engine.
ROUNDS=4 PASSES=5 CORE=2 bash examples/engine_probes/ab_rounds.sh $OUT/ab .evaldata/trees/before .evaldata/trees/after \
  --modes off,fixed --concurrency 1,32 --steps 12 --max-new-tokens 2048
