"""The tau table of README.md from bench/*/bench.json: `cost` (the default) tau as a share of `fixed`'s at c=1, beside
the last such run (`../c1_traffic_cpu_1205/bench`). `python docs/logs/length_home_cpu_1206/table.py [BENCH_DIR] > .../table.md`
(BENCH_DIR: default this folder's bench/)."""
import glob
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))


def cells(pattern):
    out = {}
    for p in glob.glob(pattern):
        for c in json.load(open(p))["results"]:
            if c["concurrency"] == 1 and c["method"] in ("fixed", "cost"):
                out[(c["dataset"], c["method"])] = c
    return out


now = cells(f"{sys.argv[1] if len(sys.argv) > 1 else here + '/bench'}/*/bench.json")
before = cells(f"{here}/../c1_traffic_cpu_1205/bench/*/bench.json")
print("| set (test prompts) | `fixed` tau | `cost` tau | share of `fixed` | 12-05 run | `cost` mean verify length | identical |")
print("|---|---|---|---|---|---|---|")
for name in sorted({d for d, _ in now}):
    f, c = now[(name, "fixed")], now[(name, "cost")]
    b = before.get((name, "cost")), before.get((name, "fixed"))
    was = f"{100 * b[0]['tau'] / b[1]['tau']:.1f}%" if all(b) else "-"
    same = "yes" if f["identical"] and c["identical"] else "**NO**"
    print(f"| {name} ({c['num_prompts']}) | {f['tau']:.2f} | {c['tau']:.2f} | {100 * c['tau'] / f['tau']:.1f}% | {was} | "
          f"{c['mean_verify_length']:.1f} | {same} |")
