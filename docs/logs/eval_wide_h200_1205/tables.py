"""BENCHMARKS' top tables from this folder's runs: greedy tau on the test slices (tau/) and wall-clock at batch 1
(wall_*/).  python docs/logs/eval_wide_h200_1205/tables.py"""

import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(pattern):
    rows = {}
    for p in sorted(glob.glob(os.path.join(HERE, pattern, "bench.json"))):
        for c in json.load(open(p))["results"]:
            rows.setdefault(c["dataset"], {})[c["method"]] = c
    return rows


def tau(c, verify=False):
    return f"{c['tau']:.2f}" + (f", {c['mean_verify_length']:.1f}" if verify else "")


def main():
    t = runs("tau/tau_*")
    print("| set (test prompts) | `fixed` tau | `fixed_wide` | drafter alone | `cost` (default), verify len | `cost_wide` | "
          "`adaptive`, verify len | prompt lookup default (10 x 2) | best of grid (chosen on validation) | fixed / PL "
          "default | fixed / PL best | fixed_wide / PL best | identical |\n|" + "---|" * 13)
    for ds, r in t.items():
        pl, best = r["prompt_lookup_exact"]["tau"], r["prompt_lookup_grid"]
        s = best["settings"]
        ident = all(c.get("identical") in (True, None) for c in r.values())
        print(f"| {ds} ({r['plain']['num_prompts']}) | **{tau(r['fixed'])}** | {tau(r['fixed_wide'])} | {tau(r['fixed_alone'])} | "
              f"{tau(r['cost'], True)} | {tau(r['cost_wide'])} | {tau(r['adaptive'], True)} | {pl:.2f} | "
              f"{best['tau']:.2f} ({s['num_tokens']} x {s['max_ngram']}) | {r['fixed']['tau'] / pl:.2f}x | "
              f"{r['fixed']['tau'] / best['tau']:.2f}x | {r['fixed_wide']['tau'] / best['tau']:.2f}x | {'yes' if ident else 'NO'} |")
    w = {**runs("wall_012/wall_*"), **runs("wall_345/wall_*")}
    ms = ("plain", "plain_static", "prompt_lookup", "prompt_lookup_tuned", "fixed", "cost", "adaptive", "fixed_wide")
    print("\n| set | " + " | ".join(f"`{m}`" for m in ms) + " | `fixed` / best of plain_static and PL | `fixed` tau "
          "(these prompts) | identical |\n|" + "---|" * (len(ms) + 4))
    for ds, r in w.items():
        v = {m: r[m]["tokens_per_s"] for m in ms}
        base = max(v["plain_static"], v["prompt_lookup"], v["prompt_lookup_tuned"])
        ident = all(c.get("identical") in (True, None) for c in r.values())
        print(f"| {ds} | " + " | ".join(f"{v[m]:.0f}" for m in ms) + f" | {v['fixed'] / base:.2f}x | "
              f"{r['fixed']['tau']:.2f} | {'yes' if ident else 'NO'} |")


if __name__ == "__main__":
    main()
