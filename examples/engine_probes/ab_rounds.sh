#!/usr/bin/env bash
# Round times of two library trees on one GPU, told apart from the machine: round_trace.py (this checkout's) runs with
# each tree's adaflash_hf first on PYTHONPATH, one process per run, alternated ROUNDS times (A B A B ...), each pinned
# to the same CPU core (taskset), timed passes only (no profiler), PASSES passes a run (each run's wall: their median).
#
#   bash examples/engine_probes/ab_rounds.sh OUT TREE_A TREE_B [round_trace flags]
#   e.g. bash examples/engine_probes/ab_rounds.sh $OUT/ab .evaldata/trees/before .evaldata/trees/after --modes off,fixed \
#          --concurrency 1,32 --steps 12 --max-new-tokens 2048    (5 passes of 12 rounds need room: round_trace says)
#
# A tree is a folder holding adaflash_hf (git archive COMMIT adaflash_hf | tar -x -C TREE; its reference weights may be
# left out: they are linked from this checkout). Writes OUT/{a,b}_K/round_trace.{json,md} and OUT/ab.md (each cell's
# median over the runs of each tree, and their ratio b / a).
set -euo pipefail
OUT=${1:?usage: ab_rounds.sh OUT TREE_A TREE_B [round_trace flags]}; A=${2:?}; B=${3:?}; shift 3
ROUNDS=${ROUNDS:-4}; PASSES=${PASSES:-5}; CORE=${CORE:-2}
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
mkdir -p "$OUT"
for tree in "$A" "$B"; do
  [[ -d $tree/adaflash_hf ]] || { echo "ab_rounds: no adaflash_hf in $tree" >&2; exit 2; }
  [[ -e $tree/adaflash_hf/reference ]] || ln -s "$ROOT/adaflash_hf/reference" "$tree/adaflash_hf/reference"
done
for k in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    tree=$A; [[ $side == b ]] && tree=$B
    PYTHONPATH="$(cd "$tree" && pwd)${PYTHONPATH:+:$PYTHONPATH}" taskset -c "$CORE" python3 "$HERE/round_trace.py" \
      --out "$OUT/${side}_$k" --passes "$PASSES" --no-profile "$@" > "$OUT/${side}_$k.log" 2>&1 \
      || { echo "ab_rounds: $side run $k failed: $OUT/${side}_$k.log" >&2; tail -3 "$OUT/${side}_$k.log" >&2; exit 1; }
    echo "ab_rounds: $side run $k done"
  done
done
python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
cells = {}
for side in "ab":
    for k in range(1, rounds + 1):
        for r in json.load(open(f"{out}/{side}_{k}/round_trace.json"))["rows"]:
            cells.setdefault((r["mode"], r["concurrency"]), {}).setdefault(side, []).append(r["wall_ms"])
lines = ["| mode | c | tree a, ms a round (median of runs; each run) | tree b | b / a |", "|---|---|---|---|---|"]
for (mode, c), v in cells.items():
    a, b = statistics.median(v["a"]), statistics.median(v["b"])
    runs = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    lines.append(f"| {mode} | {c} | {a:.3f} ({runs(v['a'])}) | {b:.3f} ({runs(v['b'])}) | {b / a:.3f} |")
open(f"{out}/ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
