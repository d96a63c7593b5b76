"""How much a round's length-head prediction says about the *next* round's acceptance, from the rounds the reference pair
verified as whole blocks in order (`docs/logs/head_calibration_cpu/head_calibration.json`: `fixed`, the first 20 prompts
of Spec-Bench's five categories and MT-bench, 128 new tokens; request boundaries are not marked there, so a few pairs
straddle two requests). The cost rule's guess for a round before its drafter runs is the request's last ratio.

    python docs/logs/c1_tau_cpu_1205/next_round.py
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = [(0, 1.3), (1.3, 1.8), (1.8, 2.5), (2.5, 4), (4, 99)]


def main() -> None:
    data = json.loads((ROOT / "head_calibration_cpu" / "head_calibration.json").read_text(encoding="utf-8"))
    B = 16
    print("| set | predicted k of a round | rounds | its realised L + 1 | the next round's | the one after |")
    print("|---|---|---|---|---|---|")
    for name in ["all", *data["traces"]]:
        traces = data["traces"].values() if name == "all" else [data["traces"][name]]
        triples = [(r[i][1] * B, r[i][0] + 1, r[i + 1][0] + 1, r[i + 2][0] + 1)
                   for t in traces for r in [t["rounds"]] for i in range(len(r) - 2)]
        for lo, hi in BUCKETS:
            sel = [x for x in triples if lo <= x[0] < hi]
            if sel:
                mean = lambda j: sum(x[j] for x in sel) / len(sel)  # noqa: E731
                print(f"| {name} | [{lo}, {hi}) | {len(sel)} | {mean(1):.2f} | {mean(2):.2f} | {mean(3):.2f} |")


if __name__ == "__main__":
    main()
