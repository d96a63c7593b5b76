"""The demo's speedups (plain time / speculative time, each run's own) per pair, and cost's as a share of fixed's.
`python docs/logs/length_home_cpu_1206/demo_table.py [RUNS_DIR] > .../demo_table.md` (RUNS_DIR: default demo/ here)"""
import os
import re
import statistics
import sys

# the runs' folder: the first argument, else this folder's demo/
here = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def read(policy, i):
    text = open(os.path.join(here, f"{policy}_{i}.txt")).read()
    speedup = float(re.search(r"measured in this run: ([0-9.]+)x", text).group(1))
    tau = float(re.search(r"tau \(mean tokens committed per verify round\): ([0-9.]+)", text).group(1))
    mean_len = float(re.search(r"verify lengths chosen \(\w+\): mean ([0-9.]+)", text).group(1))
    return speedup, tau, mean_len, "identical: True" in text


pairs = [i for i in range(1, 6) if all(os.path.exists(os.path.join(here, f"{p}_{i}.txt")) for p in ("cost", "fixed"))]
print("| pair | `fixed` speedup | `cost` speedup | `cost` / `fixed` | tau fixed / cost | cost mean verify length | identical |")
print("|---|---|---|---|---|---|---|")
ratios, fs, cs = [], [], []
for i in pairs:
    f, c = read("fixed", i), read("cost", i)
    ratios.append(c[0] / f[0]); fs.append(f[0]); cs.append(c[0])
    print(f"| {i} | {f[0]:.2f}x | {c[0]:.2f}x | {c[0] / f[0]:.3f} | {f[1]:.2f} / {c[1]:.2f} | {c[2]:.2f} | "
          f"{'yes' if f[3] and c[3] else '**NO**'} |")
if pairs:
    print(f"| median of {len(pairs)} | {statistics.median(fs):.2f}x | {statistics.median(cs):.2f}x | "
          f"{statistics.median(ratios):.3f} (medians' ratio {statistics.median(cs) / statistics.median(fs):.3f}) | | | |")
