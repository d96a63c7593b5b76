"""Issue 35's c=1 tau on the engine path, test slices, before (docs/logs/c1_guess_cpu_1205/bench: the guess of
b83f686) and after commit a9da120 (this folder's bench/): `cost` tau as a share of `fixed`'s.

    python docs/logs/c1_spent_cpu_1205/before_after.py
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE = HERE.parent / "c1_guess_cpu_1205" / "bench"


def shares(path: Path):
    rows = {r["method"]: r for r in json.loads(path.read_text(encoding="utf-8"))["results"]}
    f, c = rows["fixed"], rows["cost"]
    return f["num_prompts"], f["tau"], c["tau"], c["mean_verify_length"], all(r["identical"] for r in rows.values())


print("| set (test prompts) | `fixed` tau | `cost` tau before (share) | after (share) | verify length before -> after "
      "| identical |")
print("|---|---|---|---|---|---|")
for after in sorted(HERE.glob("bench/*/bench.json")):
    n, f, c, v, same = shares(after)
    _, f0, c0, v0, same0 = shares(BEFORE / after.parent.name / "bench.json")
    print(f"| {after.parent.name} ({n}) | {f:.2f} | {c0:.2f} ({c0 / f0:.1%}) | {c:.2f} ({c / f:.1%}) | {v0:.1f} -> {v:.1f} "
          f"| {'yes' if same and same0 else 'NO'} |")
