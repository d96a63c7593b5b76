"""Item 4's joint grid of OPD's mixing weight (alpha) x clip on the dev CPU: held-out tau after each update per cell;
the default cell (alpha 0.8, clip 0.01) is frozen__opd_s0, the same run with the file's defaults."""
import glob
import json
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "docs/logs/online_item4_cpu_1205"
cells = {}
for f in sorted(glob.glob(os.path.join(d, "grid_*/protocol.json"))) + [os.path.join(d, "frozen__opd_s0/protocol.json")]:
    j = json.load(open(f))
    curve = j["methods"]["opd"]["curve"]
    cells[(float(j["config"]["alpha"]), float(j["config"]["clip"]))] = ([c["tau"] for c in curve], all(c["identical"] for c in curve))
print("| alpha | clip | held-out tau after update 0, 1, 2, 3, 4 | last / start | mean of updates 1-4 / start | identical |")
print("|---|---|---|---|---|---|")
for (a, c), (taus, ident) in sorted(cells.items(), key=lambda kv: kv[0]):
    mean = sum(taus[1:]) / max(len(taus) - 1, 1)
    print(f"| {a} | {c} | {', '.join(f'{t:.3f}' for t in taus)} | {taus[-1] / taus[0]:.3f} | {mean / taus[0]:.3f} | {'yes' if ident else 'NO'} |")
print()
print("| alpha \\ clip | 0.001 | 0.01 | 0.1 |")
print("|---|---|---|---|")
for a in (0.5, 0.8, 0.95):
    row = []
    for c in (0.001, 0.01, 0.1):
        taus = cells.get((a, c), (None,))[0]
        row.append("not run" if taus is None else f"{taus[-1] / taus[0]:.3f} ({sum(taus[1:]) / (len(taus) - 1) / taus[0]:.3f})")
    print(f"| {a} | " + " | ".join(row) + " |")
taus = cells.get((1.0, 0.01), (None,))[0]
if taus is not None:
    print(f"| 1.0 (cross-entropy alone, no KL to clip) | {taus[-1] / taus[0]:.3f} ({sum(taus[1:]) / (len(taus) - 1) / taus[0]:.3f}) | | |")
