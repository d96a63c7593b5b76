"""The c=1 table of README.md from bench/*/bench.json: `cost` tau as a share of `fixed`'s, beside the last run before
this one on the engine path (`../c1_spent_cpu_1205/bench`, else `../c1_guess_cpu_1205/bench`).
`python docs/logs/c1_traffic_cpu_1205/table.py`"""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))


def cells(pattern):
    out = {}
    for p in glob.glob(pattern):
        for c in json.load(open(p))["results"]:
            if c["concurrency"] == 1 and c["method"] in ("fixed", "cost"):
                out[(c["dataset"], c["method"])] = c
    return out


now = cells(f"{here}/bench/*/bench.json")
before = cells(f"{here}/../c1_guess_cpu_1205/bench/*/bench.json")
before.update(cells(f"{here}/../c1_spent_cpu_1205/bench/*/bench.json"))
print("| set (test prompts) | `fixed` tau | `cost` tau | share of `fixed` | before | `cost` mean verify length | identical |")
print("|---|---|---|---|---|---|---|")
for name in sorted({d for d, _ in now}):
    f, c = now[(name, "fixed")], now[(name, "cost")]
    b = before.get((name, "cost")), before.get((name, "fixed"))
    was = f"{100 * b[0]['tau'] / b[1]['tau']:.1f}%" if all(b) else "-"
    same = "yes" if f["identical"] and c["identical"] else "**NO**"
    print(f"| {name} ({c['num_prompts']}) | {f['tau']:.2f} | {c['tau']:.2f} | {100 * c['tau'] / f['tau']:.1f}% | {was} | "
          f"{c['mean_verify_length']:.1f} | {same} |")
