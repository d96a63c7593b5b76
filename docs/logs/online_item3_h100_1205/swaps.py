"""What the guard saw against what the held-out prompts saw, for every swap of these runs; and each held-out tau's
standard error (from its accepted-draft density, rounds taken as independent).

    python docs/logs/online_item3_h100_1205/swaps.py [RUNS_DIR]    # default: per_update/ (per_update.py writes it)

Runs under RUNS_DIR (any depth) whose records carry ``guard_gain_se`` also print the guard's paired gain in standard
errors.
"""

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def standard_error(point: dict) -> float:
    density, rounds = point["accepted_density"], point["rounds"]
    mean = sum(k * p for k, p in enumerate(density))
    return math.sqrt((sum(k * k * p for k, p in enumerate(density)) - mean * mean) / rounds)


def main() -> None:
    swaps = []
    print("run | start tau | its standard error | rounds")
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "per_update"
    for path in sorted(root.rglob("protocol.json")):
        name = path.parent.name
        for method, res in json.loads(path.read_text(encoding="utf-8"))["methods"].items():
            curve = res["curve"]
            if method == "off":
                print(f"{name} | {curve[0]['tau']:.3f} | {standard_error(curve[0]):.3f} | {curve[0]['rounds']}")
                continue
            records = [u for u in res["updates"] if u["rollback_of"] is None and u["swapped"]]
            points = [(i, p) for i, p in enumerate(curve) if p.get("outcome") == "swapped"]
            for (i, p), u in zip(points, records):  # the JSON keeps the records up to its last measurement
                guard = u["guard_candidate"] / u["guard_serving"] - 1
                held = p["tau"] / curve[i - 1]["tau"] - 1
                paired = u["guard_gain"] / u["guard_gain_se"] if u.get("guard_gain_se") else float("nan")
                swaps.append((name, i, guard, paired, held, (p["tau"] - curve[0]["tau"]) / standard_error(curve[0])))
    print("\nrun | update | guard's gain on its held-back requests | that gain / its se (paired) | held-out tau change"
          " | change from start / start's se")
    for name, i, guard, paired, held, z in swaps:
        print(f"{name} | {i} | {guard:+.3f} | {paired:+.2f} | {held:+.3f} | {z:+.2f}")
    print(f"\n{len(swaps)} swaps, {sum(s[4] < 0 for s in swaps)} lowered held-out tau, "
          f"{sum(s[4] > 0 for s in swaps)} raised it")


if __name__ == "__main__":
    main()
